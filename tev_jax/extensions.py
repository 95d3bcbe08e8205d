"""The extension points: tree builders, verifiers and exit-loss node weightings.

A research extension is one pure function with one of three signatures, each a
`typing.Protocol` below (structural: any function of that signature is one):

- `TreeBuilder` ``(draft_logits_HV, root_token) -> DraftTree``, for one row: passed as
  ``DecodeConfig(builder=...)``. The engine vmaps it over the batch (or calls its
  ``batched`` form, `batched`) and reads the slot count N from its output shape while
  tracing (`builder_num_slots`). The built-in names 'ddtree', 'chain' and 'none'
  resolve to builders of the same form (`resolve_builder`).
- `Verifier` ``(key, tree, target_logits_NV, sampling, *, horizon) -> Verdict``, for
  one row: passed as ``DecodeConfig(verifier=...)``, and checked for exactness by
  `tev_jax.testing.check_lossless`. The built-in names 'tev', 'predraw', 'sequential'
  and 'greedy' resolve to verifiers of the same form (`resolve_verifier`).
- `NodeWeighting` ``(tree, law) -> weights_N``, for one tree: ExitTrain's per-node
  weights of the exit loss, passed as ``tev_jax.exit_train.ExitTrainConfig(loss=...)``
  beside the named weightings of `tev_jax.exit_train`; the library detaches them and
  zeroes the root and padding.

All three are called inside ``jax.jit`` with static shapes: no Python branching on
array values, no host callbacks. A config that holds one is a static jit argument, so
the function must be hashable: a function, a ``functools.partial`` (a partial made
anew compares unequal: build it once to reuse the compilation) or a frozen dataclass
with ``__call__`` (compared by value, like `DDTreeBuilder`). The ``check_*`` functions run on the host, on shapes only
(``jax.eval_shape``), and raise ``ValueError`` naming the field and the shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from tev_jax import ddtree, verify
from tev_jax.exit_law import ExitLaw
from tev_jax.sampling import Sampling
from tev_jax.tree import DraftTree
from tev_jax.verify import Verdict


@runtime_checkable
class TreeBuilder(Protocol):
    """Builds the draft tree of one row from the drafter's block of logits."""

    def __call__(self, draft_logits_HV: jax.Array, root_token: jax.Array) -> DraftTree:
        """Returns the tree.

        Args:
          draft_logits_HV: float32 [H, V] drafter logits; row d-1 is depth d. (The
            'none' builder, used without a drafter, receives None.)
          root_token: int32 [], the root (the pending token, slot 0).

        Returns:
          A `DraftTree` with fields [N] satisfying docs/design.md §2 (slot 0 the root, valid
          slots a prefix, parents first, depth at most H, distinct sibling tokens).
          N must not depend on values: it is read from the output shape.

        A builder may also define ``batched(draft_logits_BHV, root_B) -> DraftTree
        [B, N]`` returning the same trees for a whole batch (`DDTreeBuilder` does, for
        its top-k over a sharded vocabulary); the engine then calls it instead of
        ``jax.vmap(builder)``. A builder that knows N from its settings may define
        ``num_slots(horizon, vocab) -> N``; `builder_num_slots` then reads N without
        tracing it (DDTree's N = budget + 1, whatever the budget). A builder whose
        ``reads_draft_logits`` attribute is false receives None, and the engine skips
        drafting (`reads_draft_logits`).
        """


@runtime_checkable
class Verifier(Protocol):
    """Decides one row's accepted path and bonus token from the target's logits."""

    def __call__(self, key: jax.Array, tree: DraftTree, target_logits_NV: jax.Array,
                 sampling: Sampling, *, horizon: int) -> Verdict:
        """Returns the verdict.

        Args:
          key: a PRNG key for this row.
          tree: the row's `DraftTree` [N].
          target_logits_NV: float32 [N, V]; row i is the target's next-token logits
            after the path root..i.
          sampling: the target's sampling transform (static). With each row's own
            setting (``DecodeConfig(sampling='per_row')``) the engine applies the row's
            transform first (`tev_jax.vocab.row_scores`) and passes the transformed
            log-weights with ``Sampling(1.0)``: a verifier exact at temperature 1 is then
            exact for every row's setting.
          horizon: H, static; ``Verdict.path`` has H+1 entries.

        Returns:
          A `Verdict` with ``path`` int32 [H+1] (root first, -1 padded), ``length``,
          ``bonus`` and ``exit_node`` int32 []. Lossless means
          ``Pr(exit v, bonus y) = P(v) p_v(y)`` off v's child tokens.
        """


@runtime_checkable
class NodeWeighting(Protocol):
    """Per-node weights of ExitTrain's exit loss, for one tree."""

    def __call__(self, tree: DraftTree, law: ExitLaw) -> jax.Array:
        """Returns float weights [N], one per slot.

        Args:
          tree: one `DraftTree` [N] (the library applies the weighting over batches).
          law: its `ExitLaw` under the frozen target (fields [N]).

        The library checks the output's shape and dtype (a ValueError naming the
        weighting, `tev_jax.exit_weights.node_weights`), detaches it and zeroes the root
        and padding slots.
        """


# ------------------------------------------------------------------ built-in builders


@dataclasses.dataclass(frozen=True)
class DDTreeBuilder:
    """DDTree's best-first tree of ``budget`` nodes (`tev_jax.ddtree.build_tree`),
    N = budget + 1; a `TreeBuilder` that compares by value (two equal ones share a
    compilation)."""

    budget: int

    def __call__(self, draft_logits_HV: jax.Array, root_token: jax.Array) -> DraftTree:
        return ddtree.build_tree(draft_logits_HV, root_token, self.budget)[0]

    def batched(self, draft_logits_BHV: jax.Array, root_B: jax.Array) -> DraftTree:
        """The same trees for a batch [B, H, V], with one top-k over the whole batch, so
        that a vocabulary sharded over a mesh gets the per-shard top-k with the batch
        axis kept in place (`tev_jax.ddtree.build_trees`)."""
        return ddtree.build_trees(draft_logits_BHV, root_B, self.budget, lead_names=("batch",))

    def num_slots(self, horizon: int, vocab: int) -> int:
        """N = budget + 1, known without tracing the builder (whose tables grow with
        the budget)."""
        return self.budget + 1


def chain_builder(draft_logits_HV: jax.Array, root_token: jax.Array) -> DraftTree:
    """The drafter's argmax per row as a chain (`tev_jax.ddtree.build_chain`); N = H + 1."""
    return ddtree.build_chain(draft_logits_HV, root_token)[0]


def root_only_builder(draft_logits_HV: jax.Array | None, root_token: jax.Array) -> DraftTree:
    """The root alone (N = 1): one autoregressive step of the target per round; the
    draft logits are not read (None without a drafter). With a drafter (passed as
    ``DecodeConfig(builder=root_only_builder)``) the rounds are AR steps that still give
    the drafter the committed context, so speculative rounds can resume on the same
    state (continuous batching's AR fallback)."""
    return ddtree.build_tree(draft_logits_HV, root_token, 0)[0]


root_only_builder.reads_draft_logits = False


def reads_draft_logits(builder: TreeBuilder) -> bool:
    """Whether ``builder`` reads the draft logits. A builder with a false
    ``reads_draft_logits`` attribute gets None: the engine skips drafting the block (the
    drafter's context is still extended with what each round commits)."""
    return bool(getattr(builder, "reads_draft_logits", True))


BUILDERS: dict[str, Callable[[int], TreeBuilder]] = {
    "ddtree": DDTreeBuilder,
    "chain": lambda budget: chain_builder,
    "none": lambda budget: root_only_builder,
}
"""Builder names -> ``budget -> TreeBuilder``; the engine resolves names through it."""


def greedy_verifier(key: jax.Array, tree: DraftTree, target_logits_NV: jax.Array,
                    sampling: Sampling, *, horizon: int) -> Verdict:
    """`tev_jax.verify.greedy` as a `Verifier` (the key and sampling are not read: it
    is exact at T = 0 only, which `tev_jax.decode.DecodeConfig` checks)."""
    return verify.greedy(tree, target_logits_NV, horizon=horizon)


VERIFIERS: dict[str, Verifier] = {
    "tev": verify.tev,
    "predraw": verify.predraw,
    "sequential": verify.sequential_residual,
    "greedy": greedy_verifier,
}
"""Verifier names -> `Verifier`; the engine resolves names through it."""


def resolve_verifier(verifier: str | Verifier) -> Verifier:
    """The `Verifier` of a name in `VERIFIERS`, or ``verifier`` itself."""
    if isinstance(verifier, str):
        if verifier not in VERIFIERS:
            raise ValueError(f"verifier must be one of {tuple(VERIFIERS)} or a callable, "
                             f"got {verifier!r}")
        return VERIFIERS[verifier]
    return verifier


def batched(builder: TreeBuilder) -> Callable[[jax.Array, jax.Array], DraftTree]:
    """``builder`` over a batch ``(draft_logits_BHV, root_B) -> DraftTree [B, N]``: its
    own ``batched`` method when it has one, else ``jax.vmap(builder)``."""
    return getattr(builder, "batched", None) or jax.vmap(builder)


def resolve_builder(builder: str | TreeBuilder, budget: int) -> TreeBuilder:
    """The `TreeBuilder` of a name in `BUILDERS` (given the DDTree budget) or ``builder`` itself."""
    if isinstance(builder, str):
        if builder not in BUILDERS:
            raise ValueError(f"builder must be one of {tuple(BUILDERS)} or a callable, "
                             f"got {builder!r}")
        return BUILDERS[builder](budget)
    return builder


# ----------------------------------------------------------------------------- checks


def check_hashable(fn, field: str) -> None:
    """Raises ValueError unless ``fn`` is a hashable callable (it is a static jit argument)."""
    if not callable(fn):
        raise ValueError(f"{field} must be a name or a callable, got {fn!r}")
    try:
        hash(fn)
    except TypeError as e:
        raise ValueError(f"{field} must be hashable (configs are static jit arguments); "
                         f"use a function or a functools.partial, got {fn!r}") from e


def _shapes(x) -> str:
    return str(jax.tree.map(lambda a: (tuple(a.shape), str(a.dtype)), x))


def check_tree_struct(tree, field: str = "builder") -> int:
    """Checks a (possibly abstract) single tree's type, shapes and dtypes; returns N.

    Args:
      tree: what a builder returned (arrays or ``jax.ShapeDtypeStruct``).
      field: the name of the function that made it, for the message.

    Raises:
      ValueError: ``tree`` is not a `DraftTree`, its fields are not all [N], or have
        the wrong dtype (int32 tokens, parents, depths and bool valid).
    """
    if not isinstance(tree, DraftTree):
        raise ValueError(f"{field} must return a tev_jax.tree.DraftTree, got "
                         f"{type(tree).__name__}: {_shapes(tree)}")
    fields = {f: getattr(tree, f) for f in ("tokens", "parents", "depths", "valid")}
    shapes = {f: tuple(x.shape) for f, x in fields.items()}
    if len(set(shapes.values())) != 1 or len(shapes["tokens"]) != 1:
        raise ValueError(f"{field} returned a DraftTree whose fields must all have shape "
                         f"[N] (one row), got {shapes}")
    want = {"tokens": jnp.int32, "parents": jnp.int32, "depths": jnp.int32,
            "valid": jnp.bool_}
    bad = {f: str(fields[f].dtype) for f, d in want.items() if fields[f].dtype != d}
    if bad:
        raise ValueError(f"{field} returned DraftTree fields of the wrong dtype {bad}; "
                         "need int32 tokens, parents, depths and bool valid")
    if shapes["tokens"][-1] < 1:
        raise ValueError(f"{field} returned a DraftTree with no slots (need the root)")
    return shapes["tokens"][-1]


def builder_num_slots(builder: TreeBuilder, horizon: int, vocab: int) -> int:
    """N of ``builder``'s trees for [H, V] draft logits: its ``num_slots(horizon,
    vocab)`` when it has one (nothing traced), else its output shape (traced
    abstractly, nothing runs); raises ValueError if its output is not a [N] DraftTree."""
    known = getattr(builder, "num_slots", None)
    if callable(known):
        return int(known(horizon, vocab))
    logits = jax.ShapeDtypeStruct((horizon, vocab), jnp.float32) if horizon else None
    root = jax.ShapeDtypeStruct((), jnp.int32)
    return check_tree_struct(jax.eval_shape(builder, logits, root), "builder")


def check_verdict(verdict, horizon: int, field: str = "verifier") -> None:
    """Checks a (possibly abstract) single-row verdict's type, shapes and dtypes.

    Raises:
      ValueError: ``verdict`` is not a `Verdict`, ``path`` is not int [H+1], or
        ``length``, ``bonus``, ``exit_node`` are not int scalars.
    """
    if not isinstance(verdict, Verdict):
        raise ValueError(f"{field} must return a tev_jax.verify.Verdict, got "
                         f"{type(verdict).__name__}: {_shapes(verdict)}")
    want = {"path": (horizon + 1,), "length": (), "bonus": (), "exit_node": ()}
    got = {f: tuple(getattr(verdict, f).shape) for f in want}
    ints = all(jnp.issubdtype(getattr(verdict, f).dtype, jnp.integer) for f in want)
    if got != want or not ints:
        raise ValueError(
            f"{field} returned a Verdict with fields {_shapes(verdict)}; need integer "
            f"path [H+1] = {list(want['path'])} and scalar length, bonus, exit_node")


def check_verifier(verifier: Verifier, num_slots: int, horizon: int, vocab: int,
                   sampling: Sampling) -> None:
    """Traces ``verifier`` on abstract [N] / [N, V] inputs and checks its `Verdict`."""
    tree = DraftTree(*(jax.ShapeDtypeStruct((num_slots,), d)
                       for d in (jnp.int32, jnp.int32, jnp.int32, jnp.bool_)))
    logits = jax.ShapeDtypeStruct((num_slots, vocab), jnp.float32)
    out = jax.eval_shape(lambda k, t, x: verifier(k, t, x, sampling, horizon=horizon),
                         jax.random.key(0), tree, logits)
    check_verdict(out, horizon)


__all__ = [
    "BUILDERS", "DDTreeBuilder", "NodeWeighting", "TreeBuilder", "Verifier", "batched",
    "builder_num_slots", "chain_builder", "check_hashable", "check_tree_struct",
    "check_verdict", "check_verifier", "greedy_verifier", "reads_draft_logits",
    "resolve_builder", "resolve_verifier", "root_only_builder", "VERIFIERS",
]
