"""Meshes and logical-axis sharding: the one place that names mesh axes.

Parameters carry *logical* axis names (``nnx.Param(..., out_sharding=('embed', 'mlp'))``,
created with ``eager_sharding=False`` so that no mesh is needed to build a model), and
activations are annotated with `constrain(x, ('batch', 'seq', 'act_embed'))`. This
module maps logical names to the mesh axes ``data``, ``fsdp`` and ``tensor``:

- ``data``: batch parallelism (activations' batch axis only);
- ``fsdp``: batch parallelism that also shards parameters along their ``embed`` axis;
- ``tensor``: Megatron-style tensor parallelism over heads, MLP width and vocabulary.

A logical axis whose size is not divisible by its mesh axes is left replicated (so
tiny test models and GQA with few key/value heads still run on any mesh), and a mesh
axis is never used twice in one spec.

Typical use::

    mesh = make_mesh(data=2, tensor=4)
    model = shard_model(model, mesh)             # parameters placed by their names
    with jax.set_mesh(mesh):                      # activates the activation constraints
        logits = jax.jit(f)(graphdef, state, tokens)

Without an active mesh `constrain` is a no-op, so single-device code is unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

Rules = tuple[tuple[str, Any], ...]

DEFAULT_RULES: Rules = (
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    # activations and caches
    ("batch", ("data", "fsdp")),
    ("seq", None),
    ("layers", None),
    ("cache_len", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)

_RULES: contextvars.ContextVar[Rules] = contextvars.ContextVar("tev_rules", default=DEFAULT_RULES)


@contextlib.contextmanager
def axis_rules(rules: Rules):
    """Temporarily replaces the logical → mesh axis rules (trace time)."""
    token = _RULES.set(tuple(rules))
    try:
        yield
    finally:
        _RULES.reset(token)


def current_rules() -> Rules:
    return _RULES.get()


def make_mesh(data: int = 1, fsdp: int | None = None, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ('data', 'fsdp', 'tensor') mesh over the available devices.

    Args:
      data, tensor: axis sizes.
      fsdp: axis size; None takes all remaining devices.
      devices: defaults to ``jax.devices()``.
    """
    devices = list(jax.devices() if devices is None else devices)
    if fsdp is None:
        if len(devices) % (data * tensor):
            raise ValueError(
                f"{len(devices)} devices are not divisible by data*tensor={data * tensor}"
            )
        fsdp = len(devices) // (data * tensor)
    n = data * fsdp * tensor
    if n > len(devices) or n < 1:
        raise ValueError(
            f"mesh data={data} x fsdp={fsdp} x tensor={tensor} needs {n} devices, "
            f"{len(devices)} available"
        )
    return jax.make_mesh(
        (data, fsdp, tensor), MESH_AXES,
        axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices[:n],
    )


def _mesh_sizes(mesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.axis_sizes))


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int] | None = None,
                    mesh=None, rules: Rules | None = None) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec.

    With ``shape`` and ``mesh`` given, mesh axes that do not divide the dimension, have
    size 1, or are absent from the mesh are dropped (that dimension stays replicated).
    """
    table = dict(current_rules() if rules is None else rules)
    sizes = _mesh_sizes(mesh) if mesh is not None else None
    used: set[str] = set()
    out = []
    for i, name in enumerate(names):
        target = table.get(name) if name is not None else None
        axes = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        keep = []
        for ax in axes:
            if ax in used:
                continue
            if sizes is not None:
                if sizes.get(ax, 1) == 1:
                    continue
                if shape is not None:
                    prod = math.prod(sizes[a] for a in keep) * sizes[ax]
                    if shape[i] % prod:
                        continue
            keep.append(ax)
        used.update(keep)
        out.append(None if not keep else (keep[0] if len(keep) == 1 else tuple(keep)))
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def logical_sharding(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                     rules: Rules | None = None) -> NamedSharding:
    """A NamedSharding for an array with the given logical axes and shape."""
    return NamedSharding(mesh, logical_to_spec(names, shape, mesh, rules))


def variable_axes(v: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axis names stored on a parameter (None if it has none)."""
    names = v.get_metadata().get("out_sharding")
    return None if names is None else tuple(names)


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules | None = None):
    """A pytree matching ``state`` (values replaced by NamedShardings)."""

    def one(v):
        axes = variable_axes(v)
        shape = v.get_value().shape
        if axes is None:
            return v.replace(NamedSharding(mesh, PartitionSpec()))
        return v.replace(logical_sharding(axes, shape, mesh, rules))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_state(state: nnx.State, mesh: Mesh, rules: Rules | None = None) -> nnx.State:
    """Places every array of ``state`` with the sharding its logical names ask for."""
    shardings = state_shardings(state, mesh, rules)
    return jax.device_put(state, shardings)


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules | None = None) -> nnx.Module:
    """Shards a model's parameters in place onto ``mesh``; returns the model."""
    graphdef, state = nnx.split(model)
    state = shard_state(state, mesh, rules)
    nnx.update(model, state)
    return model


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """``with_sharding_constraint`` by logical names under an active mesh; else a no-op."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = logical_to_spec(names, x.shape, mesh)
    return jax.lax.with_sharding_constraint(x, spec)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def device_count_ok(n: int) -> bool:
    """Whether at least ``n`` devices exist (tests skip cleanly otherwise)."""
    return len(jax.devices()) >= n


__all__ = [
    "DEFAULT_RULES", "MESH_AXES", "axis_rules", "constrain", "current_rules",
    "device_count_ok", "logical_sharding", "logical_to_spec", "make_mesh",
    "replicated", "shard_model", "shard_state", "state_shardings", "variable_axes",
]
