"""How a model's stacked layer weights are laid out for a program: one stack, or one
array per layer.

`stacked_layers` gives every layer parameter a leading layer axis, and `scan_layers`
runs the layers as one ``lax.scan``: a program's size and compile time do not grow with
depth, which is what TPU programs and training want. On a GPU the scan costs the weight
stream: XLA copies each layer's slice out of the stack before its GEMM, a static slice
of an unrolled loop as much as a scan's dynamic one, and our stacked GEMM
(`stacked_dot`, which reads the stack in place) reaches about 2.1 TB/s on an H200
where XLA's own GEMMs on separate arrays reach 3.5 TB/s (a Qwen3-8B-shaped AR step:
4.4 ms with one array per layer, 7.1 ms for tev-jax's scanned step;
``experiments/gpu/h200-2026-12-04``).

`per_layer` rewrites a model state so that every stacked layer parameter is a
`PerLayer`: a tuple of one array per layer, each its own buffer (a pytree, so it is
passed to jit, sharded and donated like any array). `scan_layers` then runs the layers
as a Python loop (one program per layer) handing layer i its own arrays, so each GEMM
reads its weight where it lies. Parameters handed to the scan body whole (the MoE
experts, ``make_param(whole=True)``) stay stacked: their kernels read the stack in
place. `tev_jax.engine.Engine` lays its target out this way on GPUs
(``layer_layout='auto'``).
"""

from __future__ import annotations

from typing import Literal

import jax
from flax import nnx

LayerLayout = Literal["auto", "stacked", "per_layer"]
LAYER_LAYOUTS = ("auto", "stacked", "per_layer")


@jax.tree_util.register_pytree_node_class
class PerLayer:
    """One array per layer in place of a stacked parameter [layers, ...].

    ``arrays[i]`` is layer i's (arrays, or ``jax.ShapeDtypeStruct``s for abstract
    programs). ``shape`` / ``dtype`` describe the stack it replaces, so shape checks read
    it as they read a stacked array.
    """

    def __init__(self, arrays):
        self.arrays = tuple(arrays)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.arrays),) + tuple(self.arrays[0].shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return self.arrays[0].dtype

    def __len__(self) -> int:
        return len(self.arrays)

    def tree_flatten(self):
        return self.arrays, None

    @classmethod
    def tree_unflatten(cls, _, arrays):
        return cls(arrays)

    def __repr__(self) -> str:
        return f"PerLayer({len(self.arrays)} x {tuple(self.arrays[0].shape)})"


def is_per_layer(x) -> bool:
    return isinstance(x, PerLayer)


def _layer_sharding(sharding):
    """The sharding of one layer of a stack sharded as ``sharding`` (its layer axis
    dropped); None where there is none to keep."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return sharding.update(spec=jax.sharding.PartitionSpec(*sharding.spec[1:]))
    return sharding if isinstance(sharding, jax.sharding.SingleDeviceSharding) else None


def split_stack(x) -> PerLayer:
    """A stacked array (or ``ShapeDtypeStruct``) [layers, ...] as a `PerLayer`, each
    layer in the stack's sharding less its layer axis."""
    sharding = _layer_sharding(getattr(x, "sharding", None))
    if isinstance(x, jax.ShapeDtypeStruct):
        return PerLayer(jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding)
                        for _ in range(x.shape[0]))
    take = jax.jit(lambda w, i: w[i], static_argnums=1, out_shardings=sharding)
    return PerLayer(take(x, i) for i in range(x.shape[0]))


def _whole(var) -> bool:
    return bool(var.get_metadata().get("whole_stack", False))


def per_layer(state: nnx.State, layers_key: str = "layers") -> nnx.State:
    """``state`` with the stacked parameters of every ``layers`` module (a
    `stacked_layers` stack, found by its key anywhere in the state) as `PerLayer`s;
    whole-stack parameters (``make_param(whole=True)``) stay stacked.

    The new arrays are copies: the stacks in ``state`` are freed when nothing else holds
    them. Already split parameters are left as they are.
    """
    flat = nnx.to_flat_state(state)
    out = []
    for path, var in flat:
        if (layers_key in path and not _whole(var)
                and not is_per_layer(var.get_value())):
            var = var.replace(split_stack(var.get_value()))
        out.append((path, var))
    return nnx.from_flat_state(out)


def choose(layout: LayerLayout, platform: str) -> Literal["stacked", "per_layer"]:
    """The layout for programs on ``platform`` ('cpu', 'tpu', 'gpu'/'cuda'):
    ``'auto'`` is per layer on GPUs, stacked elsewhere.

    Raises:
      ValueError: a layout that is none of `LAYER_LAYOUTS`.
    """
    if layout not in LAYER_LAYOUTS:
        raise ValueError(f"layer_layout must be one of {', '.join(LAYER_LAYOUTS)}, "
                         f"got {layout!r}")
    if layout != "auto":
        return layout
    return "per_layer" if platform in ("gpu", "cuda") else "stacked"


__all__ = ["LAYER_LAYOUTS", "LayerLayout", "PerLayer", "choose", "is_per_layer",
           "per_layer", "split_stack"]
