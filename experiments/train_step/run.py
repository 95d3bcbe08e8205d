"""Step time of drafter training: token-only (DFlash) vs ExitTrain, with a breakdown.

Both steps run on the same batch (B sequences of L tokens, A anchors each) through the
jitted step of `train.step` (single device, float32, random weights); rollout
generation is excluded. The ExitTrain step adds three stages to the token step: DDTree
trees from the drafter's detached rows, one target forward scoring every node of every
anchor's tree, and the exit weights + exit loss. The breakdown jits each stage on its
own (so the stages do not sum exactly to the fused step):

    context          frozen target over the sequences (taps + K/V)      both steps
    drafter_fwd_bwd  drafter forward for all anchors + token loss + vjp both steps
    optimizer        clip + AdamW update                                both steps
    tree_build       vmapped DDTree over B*A anchors                    exit only
    target_scoring   one target forward over the B*A*N tree nodes       exit only
    exit_weights     exit law over [B, A, N, V] target logits           exit only
    exit_loss_grad   gathered exit loss and its gradient w.r.t. logits  exit only

All variants run round-robin (one call each per round, after a discarded warm-up
round, compile timed separately); figures are medians over rounds, of wall time and of
process CPU time (XLA's thread pool included: less disturbed by other jobs on a shared
machine).

    python experiments/train_step/run.py            # sparse + dense -> results.json
    python experiments/train_step/run.py --quick    # one small setup -> results_quick.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

# train/ is a folder of the repository, not an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tev_jax.exit_train import (
    exit_loss,
    score_tree_nodes,
    target_context,
    token_loss,
    tree_exit_weights,
)
from tev_jax.models import ModelConfig, init_target
from tev_jax.models.drafter import anchor_logits
from tev_jax.models.drafter_io import init_drafter
from tev_jax.sampling import Sampling
from train.anchors import sample_anchors
from train.step import (
    Batch,
    OptimConfig,
    StepConfig,
    block_labels,
    build_trees,
    init_state,
    merge_drafter,
    split_models,
    step_program,
)

HERE = Path(__file__).resolve().parent

# Target: the demo target of train/train_target.py (Qwen3, D=256, 6 layers, V=4096, tied);
# drafter: 1 DFlash layer tapping target layers 1 and 3, block 16 (H = 15).
# The exit stages cost about one target forward over the A*N tree nodes, so what matters
# is A*N against L: the paper's recipe (A=32 anchors, budget 32, sequences up to 3072)
# has A*N ~ L/3 or less; `sparse` is A*N = L/2 and `dense` A*N = 2L.
SETUPS = {
    "sparse": dict(batch=2, seq_len=512, anchors=8, block=16, budget=32, rounds=9),
    "dense": dict(batch=2, seq_len=256, anchors=16, block=16, budget=32, rounds=9),
    "quick": dict(batch=2, seq_len=128, anchors=8, block=16, budget=16, rounds=3),
}
TARGET = ModelConfig(model_type="qwen3", vocab_size=4096, hidden_size=256,
                     intermediate_size=768, num_layers=6, num_heads=4, num_kv_heads=2,
                     head_dim=64, tie_word_embeddings=True, qk_norm=True)
TAPS = (1, 3)


def timed(fn, *args):
    """(wall seconds, process CPU seconds) of one call up to ``block_until_ready``."""
    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0, time.process_time() - c0


def run_setup(name: str) -> dict:
    """Times both steps and the stages for one entry of `SETUPS`."""
    s = SETUPS[name]
    b, length, a, budget = s["batch"], s["seq_len"], s["anchors"], s["budget"]

    target = init_target(TARGET, key=0)
    drafter = init_drafter(target, num_layers=1, block_size=s["block"], mask_token_id=3,
                           key=1, target_layer_ids=TAPS)
    h = drafter.config.horizon
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, TARGET.vocab_size, (b, length)).astype(np.int32)
    anchors, valid = sample_anchors(rng, np.full(b, length // 4), np.full(b, length), h, a)
    batch = Batch(jnp.asarray(tokens), jnp.asarray(anchors), jnp.asarray(valid))

    graphs, frozen, params = split_models(target, drafter)
    _, param_state, _ = nnx.split(drafter, nnx.Param, ...)
    ocfg = OptimConfig(lr=1e-4, steps=1000, warmup_steps=10)
    base = StepConfig(loss="token", budget=budget, exit_lambda=0.1, sampling=Sampling(1.0),
                      taps=TAPS, horizon=h)
    cfgs = {"token": base, "exit": dataclasses.replace(base, loss="exit")}
    programs = {k: step_program(graphs, c, ocfg, None, param_state, frozen, (b, length, a))
                for k, c in cfgs.items()}
    states = {k: init_state(params, p.optimizer, p.place) for k, p in programs.items()}

    # ---- the stages, each jitted on its own
    labels = block_labels(batch.tokens, batch.anchors, h)

    @jax.jit
    def context(frozen, batch):
        return target_context(nnx.merge(graphs.target, frozen.target), batch.tokens, TAPS)

    @jax.jit
    def drafter_fwd_bwd(params, frozen, feats, batch):
        t = nnx.merge(graphs.target, frozen.target)

        def loss(p):
            logits = anchor_logits(merge_drafter(graphs, frozen, p), t, feats, batch.tokens,
                                   batch.anchors)
            mask = jnp.broadcast_to(batch.valid[:, :, None], labels.shape)
            return token_loss(logits, labels, mask).mean, logits

        return jax.grad(loss, has_aux=True)(params)

    opt = programs["token"].optimizer

    @jax.jit
    def optimizer(grads, opt_state, params):
        return opt.update(grads, opt_state, params)

    @jax.jit
    def tree_build(logits, batch):
        roots = jnp.take_along_axis(batch.tokens, batch.anchors, axis=1)
        return build_trees(logits, roots, budget)

    @jax.jit
    def target_scoring(frozen, cache, trees, batch):
        return score_tree_nodes(nnx.merge(graphs.target, frozen.target), cache, trees,
                                batch.anchors)

    @jax.jit
    def exit_weights(trees, target_logits):
        return tree_exit_weights(trees, target_logits, Sampling(1.0), "exit")

    @jax.jit
    def exit_loss_grad(logits, trees, weights):
        return jax.grad(lambda x: exit_loss(x, trees, weights).mean)(logits)

    feats, cache = context(frozen, batch)
    grads, logits = drafter_fwd_bwd(params, frozen, feats, batch)
    trees = tree_build(logits, batch)
    tlogits = target_scoring(frozen, cache, trees, batch)
    weights, _ = exit_weights(trees, tlogits)
    opt_state = jax.jit(opt.init)(params)

    def step(kind):
        def run():
            states[kind], m = programs[kind].step_fn(states[kind], batch, frozen)
            return m
        return run

    variants = {
        "token_step": step("token"),
        "exit_step": step("exit"),
        "context": lambda: context(frozen, batch),
        "drafter_fwd_bwd": lambda: drafter_fwd_bwd(params, frozen, feats, batch),
        "optimizer": lambda: optimizer(grads, opt_state, params),
        "tree_build": lambda: tree_build(logits, batch),
        "target_scoring": lambda: target_scoring(frozen, cache, trees, batch),
        "exit_weights": lambda: exit_weights(trees, tlogits),
        "exit_loss_grad": lambda: exit_loss_grad(logits, trees, weights),
    }
    # First calls: trace + compile (the stages were compiled above, making their inputs).
    compile_s = {k: timed(fn)[0] for k, fn in variants.items()}
    times = {k: [] for k in variants}
    cpu = {k: [] for k in variants}
    for r in range(s["rounds"] + 1):
        for k, fn in variants.items():
            wall, used = timed(fn)
            if r > 0:
                times[k].append(wall)
                cpu[k].append(used)
        if r > 0:
            print(f"round {r}: " + " ".join(f"{k}={times[k][-1] * 1e3:.0f}ms" for k in variants),
                  flush=True)
    med = {k: float(np.median(v)) for k, v in times.items()}
    med_cpu = {k: float(np.median(v)) for k, v in cpu.items()}
    result = {
        "setup": name,
        "shapes": {"B": b, "L": length, "A": a, "H": h, "N": budget + 1,
                   "V": TARGET.vocab_size, "tree_nodes_per_step": b * a * (budget + 1)},
        "target": {"layers": TARGET.num_layers, "hidden": TARGET.hidden_size,
                   "vocab": TARGET.vocab_size, "params": TARGET.num_params},
        "drafter": {"layers": 1, "block_size": s["block"], "taps": list(TAPS)},
        "median_ms": {k: round(v * 1e3, 2) for k, v in med.items()},
        "min_ms": {k: round(min(v) * 1e3, 2) for k, v in times.items()},
        "median_cpu_ms": {k: round(v * 1e3, 2) for k, v in med_cpu.items()},
        "compile_s": {k: round(compile_s[k], 2) for k in ("token_step", "exit_step")},
        "exit_over_token": round(med["exit_step"] / med["token_step"], 3),
        "exit_over_token_cpu": round(med_cpu["exit_step"] / med_cpu["token_step"], 3),
        "exit_extra_stages_ms": round(1e3 * sum(med[k] for k in (
            "tree_build", "target_scoring", "exit_weights", "exit_loss_grad")), 2),
        "rounds": s["rounds"],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps({k: result[k] for k in ("setup", "median_ms", "exit_over_token", "exit_over_token_cpu")}, indent=2))
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    names = ["quick"] if args.quick else ["sparse", "dense"]
    results = {
        "setups": [run_setup(n) for n in names],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "jax": jax.__version__, "backend": jax.default_backend()},
    }
    out = args.out or HERE / ("results_quick.json" if args.quick else "results.json")
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
