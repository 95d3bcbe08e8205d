"""Verifier-stage latency (paper Table 3): predraw vs TEV at B ∈ {32, 64, 128}, real logits.

The trees and logits are real decode rounds of the trained models (V = 4096): the DFlash
drafter's DDTree of budget B at contexts = evaluation prompts + the target's greedy
continuation, and the target's verify-pass logits at their nodes
(`paper_common.capture_trees`). Timed, batch 1, compile excluded, methods round-robin in a
fresh random order each repeat, median over repeats:

- ``decide``: the verifier as decode's decide stage calls it (vmapped over the batch of 1);
- ``decide + commit``: the verifier then the KV-cache commit of the accepted path (the
  paper's "verifier-decision and cache-commit" stage; cache donated, as in the fused loop);
- ``in loop``: the decide stage over all captured trees inside one jitted ``lax.scan``,
  per tree (no per-call dispatch, as inside decode's fused ``while_loop``);
- the target's tree verify forward pass over the same trees (the cost the verifier stage
  is added to), to state each verifier's latency relative to it.

At T = 0 the greedy verifier (follow the argmax) is timed too, for reference.

    python experiments/verifier_stage/run.py            # runs/ models, else the bundled ones -> results.json + README
    python experiments/verifier_stage/run.py --quick
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tev_jax.runtime.platforms import quiet_start

if __name__ == "__main__":
    quiet_start()  # before jax is imported: no libtpu or CUDA plugin lines on a CPU

import jax
import jax.numpy as jnp
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import paper_common as pc  # noqa: E402
from tev_jax.sampling import Sampling  # noqa: E402


def in_loop_call(cap, sampling, verifier, horizon):
    """Decide stage over all captured trees in one jitted scan; returns (call, trees)."""
    fn = pc.verifier_fn(verifier, sampling, horizon)
    c = cap.logits.shape[0]
    keys = jax.random.split(jax.random.key(1), c)
    tree = jax.tree.map(jnp.asarray, cap.tree)
    logits = jnp.asarray(cap.logits)

    @jax.jit
    def run(keys, tree, logits):
        def body(carry, x):
            k, t, l = x
            v = jax.vmap(fn)(k[None], jax.tree.map(lambda a: a[None], t), l[None])
            return carry + v.length[0], None
        return jax.lax.scan(body, jnp.zeros((), jnp.int32), (keys, tree, logits))[0]

    return (lambda i: run(keys, tree, logits)), c


def main():
    ap = pc.study_parser(__doc__, prompts=4)
    ap.add_argument("--budgets", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--drafter", default="dflash")
    ap.add_argument("--cuts", type=int, nargs="+", default=[0, 16])
    ap.add_argument("--latency-repeats", type=int, default=300)
    args = ap.parse_args()
    started = time.time()
    pc.enable_compile_cache(args)
    setup = pc.setup_from_args(args)
    models = pc.models_from_args(args, (args.drafter,))
    horizon = models.drafters[args.drafter].config.block_size - 1
    prompts = pc.eval_prompts(models.tokenizer, setup)
    contexts = pc.continuation_contexts(models, prompts, setup, args.cuts)
    repeats = 30 if args.quick else args.latency_repeats
    rows = []
    for budget in args.budgets:
        cap = pc.capture_trees(models, args.drafter, contexts, budget)
        cache_len = -(-(setup.prompt_len + setup.max_new_tokens + budget + 1) // 8) * 8
        for temp in setup.temperatures:
            sampling = Sampling(temperature=temp)
            verifiers = ("predraw", "tev") + (("greedy",) if temp == 0 else ())
            calls = pc.verifier_stage_calls(cap, sampling, verifiers, horizon, cache_len,
                                            models.target)
            calls["verify_forward"] = pc.verify_forward_call(models, cap, cache_len)
            loops = {}
            for v in verifiers:
                loops[v + " in loop"], n_trees = in_loop_call(cap, sampling, v, horizon)
            calls.update(loops)
            secs = pc.time_round_robin(calls, repeats, seed=setup.seed)
            med = {k: float(np.median(s)) * 1e3 for k, s in secs.items()}
            for k in loops:
                med[k] /= n_trees
            row = dict(budget=budget, slots=budget + 1, temperature=temp,
                       trees=len(contexts), repeats=repeats, median_ms=med,
                       mean_nodes=float(cap.tree.valid.sum(-1).mean()))
            rows.append(row)
            print(f"B={budget} T={temp}: " + "  ".join(f"{k} {v:.3f}" for k, v in med.items())
                  + " ms", flush=True)
    table = pc.setup_line(setup, models) + "\n\n" + tables(rows, args.drafter)
    pc.write_outputs(HERE, args, setup, models, dict(drafter=args.drafter, rows=rows),
                     table, started)


def tables(rows, drafter) -> str:
    out = []
    for r in rows:
        m = r["median_ms"]
        fwd = m["verify_forward"]
        out.append([r["budget"], f"{r['temperature']:g}", m["predraw"], m["tev"],
                    f"{m['tev'] / m['predraw']:.3f}", m["predraw+commit"], m["tev+commit"],
                    f"{m['tev+commit'] / m['predraw+commit']:.3f}",
                    f"{m['predraw in loop']:.4f}", f"{m['tev in loop']:.4f}",
                    f"{m['tev in loop'] / m['predraw in loop']:.3f}", fwd,
                    f"{m['predraw+commit'] / fwd:.3f}", f"{m['tev+commit'] / fwd:.3f}",
                    f"{m['greedy']:.3f}" if "greedy" in m else "-"])
    head = ["B", "T", "decide: predraw ms", "decide: TEV ms", "decide: TEV / predraw",
            "decide + commit: predraw ms", "decide + commit: TEV ms",
            "decide + commit: TEV / predraw", "in loop: predraw ms", "in loop: TEV ms",
            "in loop: TEV / predraw", "verify forward ms", "predraw + commit / fwd",
            "TEV + commit / fwd", "greedy ms"]
    return (f"Trees of the `{drafter}` drafter at {rows[0]['trees']} real contexts, "
            f"{rows[0]['repeats']} repeats; median ms per call (batch 1, dispatch included) "
            "and per tree inside one jitted loop. Three latencies, each with its own "
            "TEV / predraw ratio: *decide* = the verifier's decision stage alone (one "
            "jitted call); *decide + commit* = the decision then the KV-cache commit of the "
            "accepted path (the paper's Table 3 quantity, commit-inclusive); *in loop* = "
            "the decision stage per tree inside one jitted scan (no per-call dispatch; "
            "no commit).\n\n" + pc.markdown(head, out))


if __name__ == "__main__":
    main()
