"""A custom ExitTrain node weighting, trained for a few steps with the training step.

ExitTrain fine-tunes the drafter on its own draft trees: every node v of a tree built
from the drafter's rows gets a weight from the tree's exit law under the frozen target,
and the exit loss is ``- sum_v weight(v) log q_depth(v)(tokens[v])`` over the total
weight. A `tev_jax.extensions.NodeWeighting` maps one tree and its `ExitLaw` to those
weights [N]; the library applies it over the batch, detaches it and zeroes the root and
padding. This one, `sqrt_depth_exit`, sits between the named 'exit' (``w``) and
'exit_depth' (``w * depth``): ``w(v) * sqrt(depth(v))``.

`main` runs a few steps of `train.step` on the bundled target and drafter (a jitted
step: drafter forward, trees, target scoring pass, exit law, weights, loss, AdamW); the
weighting goes in as the objective's ``loss`` (`tev_jax.exit_train.ExitTrainConfig`).

Run: ``python examples/custom_weighting.py`` from any folder (or ``python -m examples.custom_weighting``
from the repository root).
"""

from __future__ import annotations

from tev_jax.runtime.platforms import quiet_start

if __name__ == "__main__":
    quiet_start()  # before jax is imported: the CPU where no accelerator is attached, quietly

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from tev_jax.exit_law import ExitLaw  # noqa: E402
from tev_jax.exit_train import ExitTrainConfig  # noqa: E402
from tev_jax.models import load_bundled  # noqa: E402
from tev_jax.sampling import Sampling  # noqa: E402
from tev_jax.tree import DraftTree  # noqa: E402
from train.optimizer import OptimConfig, make_optimizer  # noqa: E402
from train.placement import init_state, placement  # noqa: E402
from train.state import Batch, split_models  # noqa: E402
from train.step import StepConfig, make_step_fn  # noqa: E402

TEXTS = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n",
    "Question: Tom has 3 apples and buys 4 more. How many apples does he have?\n"
    "Answer: 3 + 4 = 7. He has 7 apples.\n",
)


def sqrt_depth_exit(tree: DraftTree, law: ExitLaw) -> jax.Array:
    """``w(v) * sqrt(depth(v))``: the exit law, leaning towards deeper nodes; float32 [N]."""
    return law.w * jnp.sqrt(tree.depths.astype(jnp.float32))


def batch_of(tokenizer, seq_len: int, num_anchors: int, horizon: int, seed: int = 0):
    """A `train.state.Batch` of the `TEXTS`, padded or cut to ``seq_len``, with random anchors."""
    rows = [tokenizer.encode(t).ids[:seq_len] for t in TEXTS]
    tokens = np.zeros((len(rows), seq_len), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    lengths = np.asarray([len(r) for r in rows])
    rng = np.random.default_rng(seed)
    anchors = np.stack([np.sort(rng.choice(n - horizon - 1, num_anchors, replace=False)) + 1
                        for n in lengths]).astype(np.int32)
    return Batch(tokens=jnp.asarray(tokens), anchors=jnp.asarray(anchors),
                 valid=jnp.ones(anchors.shape, bool))


def main(steps: int = 5, budget: int = 16, num_anchors: int = 4, seq_len: int = 64,
         lr: float = 1e-4) -> list[dict[str, float]]:
    """Trains the bundled drafter for ``steps`` steps with `sqrt_depth_exit`; returns the
    per-step metrics (loss, exit_loss, coverage, ...)."""
    target, drafter, tokenizer = load_bundled()
    horizon = drafter.config.block_size - 1
    objective = ExitTrainConfig(loss=sqrt_depth_exit, budget=budget, exit_lambda=1.0,
                                sampling=Sampling(1.0))
    cfg = StepConfig(objective=objective, taps=tuple(drafter.config.target_layer_ids),
                     horizon=horizon)
    graphs, frozen, params = split_models(target, drafter)
    optimizer, lr_schedule = make_optimizer(OptimConfig(lr=lr, steps=steps))
    place = placement(None, graphs, frozen, params, optimizer, (0, 0, 0))
    state = init_state(params, optimizer, place)
    step_fn = make_step_fn(graphs, cfg, optimizer, place, lr_schedule)
    batch = batch_of(tokenizer, seq_len, num_anchors, horizon)
    history = []
    for i in range(steps):
        state, metrics = step_fn(state, batch, frozen)
        history.append({k: float(v) for k, v in metrics.items()})
        print(f"step {i + 1}: " + ", ".join(f"{k} {v:.4f}" for k, v in
                                           sorted(history[-1].items())))
    return history


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--budget", type=int, default=16)
    a = p.parse_args()
    main(a.steps, a.budget)
