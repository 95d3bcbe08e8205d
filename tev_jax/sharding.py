"""Meshes and logical-axis sharding: the one place that names mesh axes.

Parameters carry *logical* axis names (``nnx.Param(..., out_sharding=('embed', 'mlp'))``,
created with ``eager_sharding=False`` so that no mesh is needed to build a model), and
activations are annotated with `constrain(x, ('batch', 'seq', 'act_embed'))`. This
module maps logical names to the mesh axes ``data``, ``fsdp`` and ``tensor``:

- ``data``: batch parallelism (activations' batch axis only);
- ``fsdp``: batch parallelism that also shards parameters along their ``embed`` axis;
- ``tensor``: Megatron-style tensor parallelism over heads, MLP width and vocabulary,
  and expert parallelism over a mixture's experts (`tev_jax.models.moe`).

Divisibility. By default a logical axis whose size is not divisible by its mesh axes
is left replicated (tiny test models and GQA with few key/value heads still run on any
mesh; the training step relies on it). ``strict=True`` (what the decode engine uses
for its parameters, caches and state) raises a ValueError naming the array, the
dimension and the mesh axis instead, so nothing is replicated silently. A mesh axis is
never used twice in one spec.

The vocabulary-sharded reductions that build on these rules (the exact top-k of a
vocabulary split across ``tensor``, the XLA:CPU barrier) live in `tev_jax.vocab`.

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
    # a mixture's stacked experts: expert parallelism over tensor; the expert width
    # takes tensor only where the experts do not (rules mapping experts to None)
    ("experts", "tensor"),
    ("moe_mlp", "tensor"),
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


TARGET_SHARDINGS = ("fsdp", "replicated")


def embed_replicated_rules(rules: Rules | None = None) -> Rules:
    """``rules`` (default: the current ones) with ``embed`` unsharded.

    A model placed by them is replicated over the batch-parallel axes and split only by
    tensor parallelism: the frozen target of a training step whose parameters are read,
    never updated (sharding them over fsdp would only add all-gathers).
    """
    rules = current_rules() if rules is None else rules
    return tuple((name, None) if name == "embed" else (name, ax) for name, ax in rules)


def frozen_target_rules(target_sharding: str) -> Rules:
    """The logical rules of a training step's frozen target, by its ``target_sharding``.

    'fsdp': the current rules (split over fsdp and tensor like the drafter, gathered
    layer by layer); 'replicated': `embed_replicated_rules`.

    Raises:
      ValueError: a name not in `TARGET_SHARDINGS`.
    """
    if target_sharding not in TARGET_SHARDINGS:
        raise ValueError(f"target_sharding must be one of {TARGET_SHARDINGS}, got "
                         f"{target_sharding!r}")
    return current_rules() if target_sharding == "fsdp" else embed_replicated_rules()


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
                    mesh=None, rules: Rules | None = None, *, strict: bool = False,
                    what: str = "array") -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec.

    With ``shape`` and ``mesh`` given, mesh axes that have size 1 or are absent from the
    mesh are dropped, and so are mesh axes that do not divide the dimension (that
    dimension stays replicated), unless ``strict``.

    Raises:
      ValueError: with ``strict``, a dimension that its mesh axes do not divide (the
        message names ``what``, the dimension, its size and the mesh axes).
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
                        if strict:
                            axes_txt = " x ".join(f"{a} ({sizes[a]})" for a in keep + [ax])
                            raise ValueError(
                                f"{what}: dimension {i} ({name}) has size {shape[i]}, which "
                                f"the mesh axes {axes_txt} do not divide; choose a mesh whose "
                                f"{ax} axis divides {shape[i]}")
                        continue
            keep.append(ax)
        used.update(keep)
        out.append(None if not keep else (keep[0] if len(keep) == 1 else tuple(keep)))
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def logical_sharding(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                     rules: Rules | None = None, *, strict: bool = False,
                     what: str = "array") -> NamedSharding:
    """A NamedSharding for an array with the given logical axes and shape."""
    return NamedSharding(mesh, logical_to_spec(names, shape, mesh, rules, strict=strict,
                                               what=what))


def variable_axes(v: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axis names stored on a parameter (None if it has none)."""
    names = v.get_metadata().get("out_sharding")
    return None if names is None else tuple(names)


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules | None = None, *,
                    strict: bool = False):
    """A pytree matching ``state`` (values replaced by NamedShardings).

    With ``strict``, a parameter dimension that its mesh axes do not divide raises a
    ValueError naming the parameter (see `logical_to_spec`).
    """

    def one(path, v):
        axes = variable_axes(v)
        shape = v.get_value().shape
        if axes is None:
            return v.replace(NamedSharding(mesh, PartitionSpec()))
        what = "parameter " + "/".join(str(getattr(k, "key", k)) for k in path)
        return v.replace(logical_sharding(axes, shape, mesh, rules, strict=strict, what=what))

    return jax.tree_util.tree_map_with_path(
        one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


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


def mesh_axis_size(names: Sequence[str], mesh=None) -> int:
    """Product of the sizes of the mesh axes ``names`` map to, on ``mesh`` (default: the
    active abstract mesh).

    1 without a mesh. Used at trace time, e.g. for how many shards the vocabulary has.
    """
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh.empty:
        return 1
    table, sizes = dict(current_rules()), _mesh_sizes(mesh)
    total = 1
    for name in names:
        target = table.get(name)
        for ax in (() if target is None else (target,) if isinstance(target, str) else target):
            total *= sizes.get(ax, 1)
    return total


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def device_count_ok(n: int) -> bool:
    """Whether at least ``n`` devices exist (tests skip cleanly otherwise)."""
    return len(jax.devices()) >= n


__all__ = [
    "DEFAULT_RULES", "MESH_AXES", "TARGET_SHARDINGS", "axis_rules", "constrain",
    "current_rules", "device_count_ok", "embed_replicated_rules", "frozen_target_rules",
    "logical_sharding", "logical_to_spec", "make_mesh", "mesh_axis_size", "replicated",
    "shard_model", "shard_state", "state_shardings", "variable_axes",
]
