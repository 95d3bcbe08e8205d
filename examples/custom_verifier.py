"""Two hand-written verifiers checked with `tev_jax.testing.check_lossless`.

A `tev_jax.extensions.Verifier` maps ``(key, tree, target_logits_NV, sampling, *,
horizon)`` to a `Verdict` for one row. Two are written here from the library's public
pieces (`exit_law`, `sampling.log_probs`, `tree.path_to`):

- `exit_first`: draw the exit node from the exit law ``w``, then the bonus from the
  target's distribution at the exit with its children's tokens removed (TEV, written
  with ``jax.random.categorical``). Lossless.
- `typical_acceptance`: accept the most likely child while the target gives it at
  least ``threshold`` probability (a Medusa-style "typical" rule), and draw the bonus
  from the full distribution at the exit. Fast and plausible, but lossy.

`main` builds a DDTree from the bundled drafter for one prompt, scores its nodes with
the bundled target, and runs the harness on both: the first passes, the second is
rejected, and the report says why.

Run: ``python examples/custom_verifier.py`` from any folder (or ``python -m examples.custom_verifier``
from the repository root).
"""

from __future__ import annotations

from tev_jax.runtime.platforms import quiet_start

if __name__ == "__main__":
    quiet_start()  # before jax is imported: the CPU where no accelerator is attached, quietly

import argparse  # noqa: E402
import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from tev_jax import ddtree, testing
from tev_jax.exit_law import exit_law  # noqa: E402
from tev_jax.models import load_bundled  # noqa: E402
from tev_jax.models.drafter import draft_step, init_drafter_cache  # noqa: E402
from tev_jax.sampling import Sampling, log_probs  # noqa: E402
from tev_jax.tree import DraftTree, ancestor_mask, children_mask, path_to  # noqa: E402
from tev_jax.verify import Verdict  # noqa: E402


def verdict(tree: DraftTree, exit_node, bonus, horizon: int) -> Verdict:
    """The `Verdict` of stopping at ``exit_node`` with ``bonus``."""
    exit_node = exit_node.astype(jnp.int32)
    return Verdict(path=path_to(tree, exit_node, horizon),
                   length=tree.depths[exit_node] + 1,
                   bonus=bonus.astype(jnp.int32), exit_node=exit_node)


def without_children(tree: DraftTree, logp_NV: jax.Array, node) -> jax.Array:
    """``log p_node`` with the tokens of ``node``'s children removed; [V]."""
    vocab = logp_NV.shape[-1]
    kid_tokens_N = jnp.where(children_mask(tree)[node], tree.tokens, vocab)
    covered_V = jnp.zeros(vocab, bool).at[kid_tokens_N].set(True, mode="drop")
    return jnp.where(covered_V, -jnp.inf, logp_NV[node])


def exit_first(key, tree: DraftTree, target_logits_NV, sampling: Sampling, *,
               horizon: int) -> Verdict:
    """Exit node ~ w, bonus ~ the residual at the exit (lossless)."""
    k_exit, k_bonus = jax.random.split(key)
    exit_node = jax.random.categorical(k_exit, jnp.log(exit_law(tree, target_logits_NV,
                                                                sampling).w))
    logp_NV = log_probs(target_logits_NV, sampling)
    bonus = jax.random.categorical(k_bonus, without_children(tree, logp_NV, exit_node))
    return verdict(tree, exit_node, bonus, horizon)


def typical_acceptance(key, tree: DraftTree, target_logits_NV, sampling: Sampling, *,
                       horizon: int, threshold: float = 0.1) -> Verdict:
    """Follow the likeliest child while its target probability >= ``threshold`` (lossy)."""
    logp_NV = log_probs(target_logits_NV, sampling)
    parent_N = jnp.maximum(tree.parents, 0)
    a_N = jnp.where(tree.depths > 0, jnp.exp(logp_NV[parent_N, tree.tokens]), 0.0)
    sibling_NN = children_mask(tree)[parent_N]
    best_N = a_N >= jnp.max(jnp.where(sibling_NN, a_N[None, :], 0.0), axis=-1)
    ok_N = (tree.depths == 0) | ((a_N >= threshold) & best_N & tree.valid)
    reached_N = tree.valid & jnp.all(~ancestor_mask(tree) | ok_N[None, :], axis=-1)
    exit_node = jnp.argmax(jnp.where(reached_N, tree.depths, -1))
    bonus = jax.random.categorical(key, logp_NV[exit_node])
    return verdict(tree, exit_node, bonus, horizon)


@functools.partial(nnx.jit, static_argnames="budget")
def _tree_and_logits(target, drafter, ids, budget: int):
    context, root = ids[None, :-1], ids[-1]
    cfg = drafter.config
    _, feats = target(context, taps=cfg.target_layer_ids)
    cache = init_drafter_cache(cfg, 1, ids.shape[0] + cfg.block_size)
    draft_BHV, _ = draft_step(drafter, target, cache, feats,
                              jnp.asarray([context.shape[1]]), root[None])
    tree, _ = ddtree.build_tree(draft_BHV[0], root, budget)
    # One forward over context + tree: node i sits at position len(context) + depth(i)
    # and sees the context and its own ancestors.
    c, n = context.shape[1], tree.num_slots
    mask = jnp.block([[jnp.tril(jnp.ones((c, c), bool)), jnp.zeros((c, n), bool)],
                      [jnp.ones((n, c), bool), ancestor_mask(tree)]])
    tokens = jnp.concatenate([context[0], tree.tokens])
    positions = jnp.concatenate([jnp.arange(c), c + tree.depths])
    logits, _ = target(tokens[None], positions[None], mask[None])
    return tree, logits[0, c:]


def bundled_tree(prompt: str, budget: int):
    """A DDTree from the bundled drafter at the end of ``prompt``, and the bundled
    target's logits at its nodes; -> (tree [N], target_logits_NV, horizon)."""
    target, drafter, tokenizer = load_bundled()
    ids = jnp.asarray(tokenizer.encode(prompt).ids, jnp.int32)
    tree, logits = _tree_and_logits(target, drafter, ids, budget)
    return tree, np.asarray(logits), drafter.config.block_size - 1


def main(prompt: str = "def fibonacci(n):", budget: int = 8, num_draws: int = 100_000,
         temperature: float = 1.0) -> dict[str, testing.LosslessReport]:
    """Checks both verifiers on one bundled-model tree; returns their reports."""
    tree, logits_NV, horizon = bundled_tree(prompt, budget)
    sampling = Sampling(temperature)
    reports = {}
    for name, verifier in [("exit_first", exit_first),
                           ("typical_acceptance", typical_acceptance)]:
        reports[name] = testing.check_lossless(verifier, tree, logits_NV, sampling,
                                               horizon=horizon, num_draws=num_draws)
        print(f"{name}: {reports[name]}")
    return reports


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--num-draws", type=int, default=100_000)
    p.add_argument("--temperature", type=float, default=1.0)
    a = p.parse_args()
    main(a.prompt, a.budget, a.num_draws, a.temperature)
