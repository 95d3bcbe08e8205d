"""Step time of drafter training: token-only (DFlash) vs ExitTrain, with a breakdown.

Both steps run on the same batch (B sequences of L tokens, A anchors each) through the
jitted step of `train.step` (single device, float32); rollout generation is excluded
from the timings. Models: the bundled demo target and its DFlash drafter
(`tev_jax.models.load_bundled`); sequences: the target's own answers (T = 1) to bundled
GSM prompts, as in `train.rollouts`. The ExitTrain step adds three stages to the token
step: DDTree trees from the drafter's detached rows, one target forward scoring the
tree nodes, and the exit weights + exit loss. The breakdown jits each stage on its
own (so the stages do not sum exactly to the fused step):

    context          frozen target over the sequences (taps + K/V)      both steps
    drafter_fwd_bwd  drafter forward for all anchors + token loss + vjp both steps
    optimizer        clip + AdamW update                                both steps
    tree_build       vmapped DDTree over B*A anchors                    exit only
    target_scoring   one target forward over the B*A*N tree nodes       exit only
    parent_scoring   the same over the nodes with children only         exit_skip only
    exit_weights     exit law over [B, A, N, V] target logits           exit only
    exit_loss_grad   gathered exit loss and its gradient w.r.t. logits  exit only

``exit_skip`` is the ExitTrain step with ``StepConfig.score_capacities`` (leaves are not
scored: the nodes with children go into the smallest of 1/4, 1/2 or 3/4 of a row's
A*N query slots that holds them; else every node is scored). Its cost
depends on the trees, so it runs with the trained drafter and with two sharpened
copies (final-norm weight x2, x3: more confident rows, deeper trees, more nodes with
children) standing in for stronger drafters.

All variants run round-robin (one call each per round in a shuffled order, after a
discarded warm-up round, compile timed separately); figures are medians over rounds, of
wall time and of process CPU time (XLA's thread pool included: less disturbed by other
jobs on a shared machine), and quartiles of the per-round CPU-time ratios.

    python experiments/train_step/run.py            # sparse + dense -> results.json
    python experiments/train_step/run.py --quick    # one small setup -> results_quick.json
    python experiments/train_step/run.py --no-leaf-skip   # token / exit steps only
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

from tev_jax.runtime.platforms import quiet_start

if __name__ == "__main__":
    quiet_start()  # before jax is imported: no libtpu or CUDA plugin lines on a CPU

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tev_jax.data.prompts import prompt_set
from tev_jax.ddtree import build_trees
from tev_jax.exit_train import ExitTrainConfig, block_labels
from tev_jax.exit_weights import exit_loss, token_loss, tree_exit_weights
from tev_jax.models import load_bundled
from tev_jax.models.drafter import anchor_logits, default_target_layer_ids
from tev_jax.sampling import Sampling
from tev_jax.tree_scoring import score_tree_nodes, target_context
from train.anchors import sample_anchors
from train.rollouts import RolloutConfig, generate_responses
from train.optimizer import OptimConfig
from train.placement import init_state
from train.state import Batch, merge_drafter, split_models
from train.step import StepConfig, step_program

HERE = Path(__file__).resolve().parent

# The exit stages cost about one target forward over the A*N tree nodes, so what matters
# is A*N against L: the paper's recipe (A=32 anchors, budget 32, sequences up to 3072)
# has A*N ~ L/3 or less; `sparse` is A*N = L/2 and `dense` A*N = 2L.
SETUPS = {
    "sparse": dict(batch=2, seq_len=512, anchors=8, budget=32, rounds=15),
    "dense": dict(batch=2, seq_len=256, anchors=16, budget=32, rounds=15),
    "quick": dict(batch=2, seq_len=128, anchors=8, budget=16, rounds=3),
}
CAPACITIES = (0.25, 0.5, 0.75)     # exit_skip: query slots per row, fractions of A * N
SHARPEN = {"trained": 1.0, "x2": 2.0, "x3": 3.0}


def timed(fn, *args):
    """(wall seconds, process CPU seconds) of one call up to ``block_until_ready``."""
    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0, time.process_time() - c0


def rollouts(target, tokenizer, b: int, length: int, seed: int = 0):
    """B target answers to GSM prompts: tokens int32 [B, L], response starts and ends."""
    prompts = [tokenizer.encode(t).ids[:length // 4] for t in prompt_set("gsm")[:b]]
    cfg = RolloutConfig(max_new_tokens=length - min(map(len, prompts)), batch_size=b,
                        seed=seed)
    tokens = np.zeros((b, length), np.int32)
    starts, ends = np.zeros(b, np.int64), np.zeros(b, np.int64)
    for i, (p, r) in enumerate(zip(prompts, generate_responses(target, prompts, cfg))):
        seq = np.concatenate([np.asarray(p, np.int32), r])[:length]
        tokens[i, :len(seq)] = seq
        starts[i], ends[i] = len(p), len(seq)
    return tokens, starts, ends


def tree_shape(trees, valid, slots: int) -> dict:
    """Mean nodes, nodes with children and depth of the trees; the largest share of a
    row's A*N slots taken by nodes with children (exit_skip's branch: the smallest of
    CAPACITIES at or above it)."""
    parents, tvalid, depths = (np.asarray(x) for x in (trees.parents, trees.valid,
                                                       trees.depths))
    n = parents.shape[-1]
    edge = tvalid & (np.arange(n) > 0)
    has_child = (np.where(edge, parents, -1)[..., None, :] == np.arange(n)[:, None]).any(-1)
    per_row = (has_child & valid[:, :, None]).sum((1, 2))
    return {"nodes": float(tvalid.sum(-1).mean()), "with_children": float(has_child.sum(-1).mean()),
            "max_depth": float(depths.max(-1).mean()),
            "max_row_share": float(per_row.max() / slots)}


def run_setup(name: str, leaf_skip: bool) -> dict:
    """Times both steps and the stages for one entry of `SETUPS`."""
    s = SETUPS[name]
    load_before = [round(x, 2) for x in os.getloadavg()]
    b, length, a, budget = s["batch"], s["seq_len"], s["anchors"], s["budget"]

    target, drafter, tokenizer = load_bundled()
    taps = tuple(drafter.config.target_layer_ids)
    h = drafter.config.horizon
    t0 = time.perf_counter()
    tokens, starts, ends = rollouts(target, tokenizer, b, length)
    rollout_s = time.perf_counter() - t0
    anchors, valid = sample_anchors(np.random.default_rng(0), starts, ends, h, a)
    batch = Batch(jnp.asarray(tokens), jnp.asarray(anchors), jnp.asarray(valid))

    graphs, frozen, params = split_models(target, drafter)
    _, param_state, _ = nnx.split(drafter, nnx.Param, ...)
    ocfg = OptimConfig(lr=1e-4, steps=1000, warmup_steps=10)
    token = ExitTrainConfig(loss="token", budget=budget, exit_lambda=0.1,
                            sampling=Sampling(1.0))
    objectives = {"token": token, "exit": dataclasses.replace(token, loss="exit")}
    if leaf_skip:
        objectives["exit_skip"] = dataclasses.replace(token, loss="exit",
                                                      score_capacities=CAPACITIES)
    cfgs = {k: StepConfig(objective=o, taps=taps, horizon=h) for k, o in objectives.items()}
    programs = {k: step_program(graphs, c, ocfg, None, param_state, frozen, (b, length, a))
                for k, c in cfgs.items()}

    def sharpened(scale):
        p = jax.tree.map(lambda x: x, params)
        p["norm"]["weight"] = p["norm"]["weight"] * scale
        return p

    runs = {"token": ("token", 1.0), "exit": ("exit", 1.0)}
    if leaf_skip:
        runs.update({f"exit_skip_{k}": ("exit_skip", v) for k, v in SHARPEN.items()})
    states = {k: init_state(sharpened(sc), programs[c].optimizer, programs[c].place)
              for k, (c, sc) in runs.items()}

    # ---- the stages, each jitted on its own
    labels = block_labels(batch.tokens, batch.anchors, h)

    @jax.jit
    def context(frozen, batch):
        return target_context(nnx.merge(graphs.target, frozen.target), batch.tokens, taps)

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
    slots = a * (budget + 1)
    shapes = {k: tree_shape(tree_build(logits * sc, batch), valid, slots)
              for k, sc in SHARPEN.items()}

    def step(run):
        kind = runs[run][0]

        def call():
            states[run], m = programs[kind].step_fn(states[run], batch, frozen)
            return m
        return call

    variants = {k: step(k) for k in runs}
    variants.update({
        "context": lambda: context(frozen, batch),
        "drafter_fwd_bwd": lambda: drafter_fwd_bwd(params, frozen, feats, batch),
        "optimizer": lambda: optimizer(grads, opt_state, params),
        "tree_build": lambda: tree_build(logits, batch),
        "target_scoring": lambda: target_scoring(frozen, cache, trees, batch),
        "exit_weights": lambda: exit_weights(trees, tlogits),
        "exit_loss_grad": lambda: exit_loss_grad(logits, trees, weights),
    })
    if leaf_skip:
        from tev_jax.tree_scoring import score_parent_nodes

        @jax.jit
        def parent_scoring(frozen, cache, trees, batch):
            return score_parent_nodes(nnx.merge(graphs.target, frozen.target), cache, trees,
                                      batch.anchors,
                                      [int(np.ceil(f * slots)) for f in CAPACITIES],
                                      batch.valid)

        variants["parent_scoring"] = lambda: parent_scoring(frozen, cache, trees, batch)
    # First calls: trace + compile (the stages were compiled above, making their inputs).
    compile_s = {k: timed(fn)[0] for k, fn in variants.items()}
    times = {k: [] for k in variants}
    cpu = {k: [] for k in variants}
    order = np.random.default_rng(1)
    for r in range(s["rounds"] + 1):
        # A fresh order each round: a call right after one that allocates large buffers
        # (or after a disturbance) runs slower.
        for k in order.permutation(list(variants)):
            wall, used = timed(variants[k])
            if r > 0:
                times[k].append(wall)
                cpu[k].append(used)
        if r > 0:
            print(f"round {r}: " + " ".join(f"{k}={times[k][-1] * 1e3:.0f}ms" for k in variants),
                  flush=True)
    med = {k: float(np.median(v)) for k, v in times.items()}
    med_cpu = {k: float(np.median(v)) for k, v in cpu.items()}
    steps = [k for k in runs if k != "token"]
    tc = target.config
    result = {
        "setup": name,
        "shapes": {"B": b, "L": length, "A": a, "H": h, "N": budget + 1, "V": tc.vocab_size,
                   "tree_nodes_per_step": b * a * (budget + 1)},
        "target": {"layers": tc.num_layers, "hidden": tc.hidden_size, "vocab": tc.vocab_size,
                   "params": tc.num_params},
        "drafter": {"layers": drafter.config.num_layers, "block_size": drafter.config.block_size,
                    "taps": list(taps),
                    "library_default_taps": list(default_target_layer_ids(
                        tc.num_layers, drafter.config.num_layers))},
        "median_ms": {k: round(v * 1e3, 2) for k, v in med.items()},
        "min_ms": {k: round(min(v) * 1e3, 2) for k, v in times.items()},
        "median_cpu_ms": {k: round(v * 1e3, 2) for k, v in med_cpu.items()},
        "compile_s": {k: round(compile_s[k], 2) for k in runs},
        "over_token": {k: round(med[k] / med["token"], 3) for k in steps},
        "over_token_cpu": {k: round(med_cpu[k] / med_cpu["token"], 3) for k in steps},
        # Quartiles over rounds of the ratio within a round (calls seconds apart).
        "over_token_cpu_per_round": {
            k: [round(float(q), 3) for q in np.percentile(
                np.asarray(cpu[k]) / np.asarray(cpu["token"]), [25, 50, 75])] for k in steps},
        "trees": shapes,
        "score_capacities": CAPACITIES if leaf_skip else None,
        "rollout_s": round(rollout_s, 1),
        "rounds": s["rounds"],
        "load_avg_before": load_before,
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps({k: result[k] for k in ("setup", "median_cpu_ms", "over_token",
                                             "over_token_cpu", "over_token_cpu_per_round",
                                             "trees")}, indent=2))
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-leaf-skip", action="store_true",
                    help="time only the token and ExitTrain steps (and their stages)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    names = ["quick"] if args.quick else ["sparse", "dense"]
    results = {
        "setups": [run_setup(n, not args.no_leaf_skip) for n in names],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "jax": jax.__version__, "backend": jax.default_backend()},
    }
    out = args.out or HERE / ("results_quick.json" if args.quick else "results.json")
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
