"""Cost of one DFlash drafting step against one target decode step and one verify pass.

A drafting step is what the decode engine runs per round: append the accepted path's
context features to the drafter cache (H + 1 feature rows, padded) and run the block
forward with the target's embedding and lm_head (`tev_jax.models.drafter.draft_step`).
It is compared with
- one target decode step (one token, `Target.decode`), and
- one tree verify pass (N = budget + 1 tree tokens with the ancestor mask and the
  drafter's taps, `Target.verify_tree`),
all jitted over ``(graphdef, state)`` with the caches donated, at the same context
length, batch 1, float32, random weights, block 16, N = 65. Every variant of a setup
(target depths x drafter depths; shallower models share the deeper one's arrays) runs
round-robin in one loop and each figure is a median over rounds, so ratios and
per-layer slopes come from the same machine load.

Setups:
- ``demo``: the demo target of ``train/demo/train_target.py`` (D=256, 6 layers, 4/2 heads,
  head_dim 64, MLP 768, V=4096, tied) with 1- and 2-layer drafters tapping layers 1, 3.
- ``qwen3-4b``: Qwen3-4B's layer shape (D=2560, 32/8 heads, head_dim 128, MLP 9728,
  V=151 936, tied) at reduced depth: targets of 1 and 2 layers, drafters of 1 and 2
  layers (two taps). The slope between depths is the per-layer cost; the intercept is
  the depth-independent part (embedding, lm_head, cache writes, dispatch).

    python experiments/drafter_step/run.py            # both -> results.json
    python experiments/drafter_step/run.py --quick    # demo only, fewer repeats -> results_quick.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import time
from pathlib import Path

from tev_jax.runtime.platforms import quiet_start

if __name__ == "__main__":
    quiet_start()  # before jax is imported: no libtpu or CUDA plugin lines on a CPU

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tev_jax.models import ModelConfig, Target
from tev_jax.models import drafter as dr
from tev_jax.models.drafter_io import drafter_config_for

HERE = Path(__file__).resolve().parent
BLOCK = 16
BUDGET = 64


def qwen3(vocab, hidden, inter, layers, heads, kv_heads, head_dim, theta):
    return ModelConfig(model_type="qwen3", vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=inter, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=theta,
                       tie_word_embeddings=True, qk_norm=True)


SETUPS = {
    "demo": dict(target=lambda n: qwen3(4096, 256, 768, n, 4, 2, 64, 1e4),
                 target_layers=(6,), drafter_layers=(1, 2), taps=(1, 3), context=256,
                 max_len=512),
    "qwen3-4b": dict(target=lambda n: qwen3(151936, 2560, 9728, n, 32, 8, 128, 1e6),
                     target_layers=(1, 2), drafter_layers=(1, 2), taps=(0, 0), context=1024,
                     max_len=1280),
}


def build(make):
    """``make()``'s module with normal(0.02) kernels and unit norms, from one jitted draw
    per parameter with an RBG key (compiling threefry per shape is slow on CPU)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    leaves, treedef = jax.tree.flatten(abstract)

    @jax.jit
    def init(key):
        keys = jax.random.split(key, len(leaves))
        return jax.tree.unflatten(treedef, [
            jnp.ones(a.shape, a.dtype) if len(a.shape) == 1
            else 0.02 * jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, leaves)])

    return nnx.merge(graphdef, init(jax.random.key(0, impl="rbg")))


def first_layers(model, make_shallow):
    """A shallower model of the same family that shares ``model``'s arrays."""
    graphdef, abstract = nnx.split(nnx.eval_shape(make_shallow))
    keep = {p for p, _ in nnx.to_flat_state(abstract)}
    flat = [(p, v) for p, v in nnx.to_flat_state(nnx.state(model)) if p in keep]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def random_tree(n: int, horizon: int, rng: np.random.Generator):
    """Tokens, depths and ancestor mask [N, N] of a random tree of n slots, depth <= H."""
    parents, depths = [-1], [0]
    for i in range(1, n):
        ok = [j for j in range(i) if depths[j] < horizon]
        p = int(rng.choice(ok[-8:]))  # prefer recent slots: deep, DDTree-like trees
        parents.append(p)
        depths.append(depths[p] + 1)
    anc = np.eye(n, dtype=bool)
    for i in range(1, n):
        anc[i] |= anc[parents[i]]
    return np.asarray(depths, np.int32), anc


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _decode(gdef, state, cache, tok_B, start_B):
    target = nnx.merge(gdef, state)
    logits, _, cache = target.decode(cache, tok_B, start_B)
    return logits, cache


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=3)
def _verify(gdef, taps, state, cache, tok_BN, depth_BN, anc_BNN, start_B):
    target = nnx.merge(gdef, state)
    logits, feats, cache = target.verify_tree(cache, tok_BN, depth_BN, anc_BNN, start_B,
                                              taps=taps)
    return logits, feats, cache


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=4)
def _draft(gd, gt, ds, ts, cache, feats_BTF, num_B, roots_B):
    logits, cache = dr.draft_step(nnx.merge(gd, ds), nnx.merge(gt, ts), cache, feats_BTF,
                                  num_B, roots_B)
    return logits, cache


def time_round_robin(calls: dict, repeats: int, min_time: float):
    """calls: key -> (compiled fn, args, index of the donated cache arg, fix-up).

    Every round runs each call once (a first round is discarded as warm-up). Each call's
    returned cache (its last output) goes through the fix-up outside the timed region
    and is fed back. Returns {key: [ms, ...]}.
    """
    times = {key: [] for key in calls}
    state = {key: list(args) for key, (_, args, _, _) in calls.items()}
    start, rounds = time.perf_counter(), -1
    while rounds < repeats or (time.perf_counter() - start < min_time and rounds < 4 * repeats):
        for key, (fn, _, ci, fix) in calls.items():
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(*state[key]))
            if rounds >= 0:
                times[key].append((time.perf_counter() - t0) * 1e3)
            state[key][ci] = fix(out[-1])
        rounds += 1
    return times


def _compile(fn, args, n_static, donated, fix):
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    ms = (time.perf_counter() - t0) * 1e3
    # compiled executables take the non-static arguments only
    return (compiled, list(args[n_static:]), donated - n_static, fix), ms


def run_setup(setup: dict, repeats: int, min_time: float, seed: int = 0) -> dict:
    """Times every (target depth, drafter depth) variant of a setup in one round-robin.

    The shallower targets and drafters share the deepest one's arrays.
    """
    rng = np.random.default_rng(seed)
    depths_t, depths_d = sorted(setup["target_layers"]), sorted(setup["drafter_layers"])
    taps, context, max_len = setup["taps"], setup["context"], setup["max_len"]
    deep_cfg = setup["target"](depths_t[-1])
    deep_target = build(lambda: Target(deep_cfg, rngs=nnx.Rngs(0)))
    targets = {n: first_layers(deep_target, lambda n=n: Target(setup["target"](n),
                                                                rngs=nnx.Rngs(0)))
               for n in depths_t}
    dcfgs = {n: drafter_config_for(deep_cfg, num_layers=n, block_size=BLOCK,
                                   mask_token_id=deep_cfg.vocab_size - 1,
                                   target_layer_ids=taps) for n in depths_d}
    deep_drafter = build(lambda: dr.Drafter(dcfgs[depths_d[-1]], rngs=nnx.Rngs(0)))
    drafters = {n: first_layers(deep_drafter, lambda n=n: dr.Drafter(dcfgs[n], rngs=nnx.Rngs(0)))
                for n in depths_d}

    b, n_slots, h = 1, BUDGET + 1, BLOCK - 1
    start = jnp.full((b,), context, jnp.int32)
    depths, anc = random_tree(n_slots, h, rng)
    tokens = jnp.asarray(rng.integers(0, deep_cfg.vocab_size - 1, (b, n_slots)), jnp.int32)
    feats = jnp.asarray(rng.standard_normal((b, h + 1, dcfgs[depths_d[0]].feature_size)),
                        jnp.float32)

    def same(cache):
        return cache

    def reset_lengths(cache):  # time the draft step at a constant context length
        return cache.replace(lengths=jnp.full((b,), context - 4, jnp.int32))

    calls, compile_ms = {}, {}
    for n, target in targets.items():
        gt, ts = nnx.split(target)
        calls[f"target_decode/{n}"], compile_ms[f"target_decode/{n}"] = _compile(
            _decode, (gt, ts, target.init_cache(b, max_len), tokens[:, 0], start), 1, 2, same)
        calls[f"tree_verify/{n}"], compile_ms[f"tree_verify/{n}"] = _compile(
            _verify, (gt, taps, ts, target.init_cache(b, max_len), tokens,
                      jnp.asarray(depths)[None], jnp.asarray(anc)[None], start), 2, 3, same)
    gt, ts = nnx.split(deep_target)  # the drafter only uses its embedding and lm_head
    for n, drafter in drafters.items():
        gd, ds = nnx.split(drafter)
        cache = reset_lengths(dr.init_drafter_cache(drafter.config, b, max_len))
        calls[f"draft_step/{n}"], compile_ms[f"draft_step/{n}"] = _compile(
            _draft, (gd, gt, ds, ts, cache, feats, jnp.full((b,), 4, jnp.int32),
                     tokens[:, 0]), 2, 4, reset_lengths)
    all_ms = time_round_robin(calls, repeats, min_time)
    median = {k: float(np.median(t)) for k, t in all_ms.items()}
    result = {
        "context": context, "tree_slots": n_slots, "block_size": BLOCK, "batch": b,
        "taps": list(taps), "target_params": {n: t.config.num_params for n, t in targets.items()},
        "median_ms": median, "min_ms": {k: float(np.min(t)) for k, t in all_ms.items()},
        "compile_ms": compile_ms, "samples": len(next(iter(all_ms.values()))),
        "ratios": {},
    }
    for nt in depths_t:
        for nd in depths_d:
            d = median[f"draft_step/{nd}"]
            result["ratios"][f"target {nt}L, drafter {nd}L"] = {
                "draft_over_decode": d / median[f"target_decode/{nt}"],
                "draft_over_verify": d / median[f"tree_verify/{nt}"]}
    per = {}
    for name, ds_ in (("target_decode", depths_t), ("tree_verify", depths_t),
                      ("draft_step", depths_d)):
        if len(ds_) >= 2:
            n1, n2 = ds_[0], ds_[-1]
            slope = (median[f"{name}/{n2}"] - median[f"{name}/{n1}"]) / (n2 - n1)
            per[name] = {"per_layer_ms": slope,
                         "depth_independent_ms": median[f"{name}/{n1}"] - n1 * slope}
    result["per_layer"] = per
    return result


def parse_args(argv=None) -> argparse.Namespace:
    """The flags; ``out`` defaults to results.json, results_quick.json with ``--quick``
    (a quick run never replaces the full run's results)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="demo only, few repeats")
    ap.add_argument("--setups", nargs="*", default=None, choices=sorted(SETUPS))
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--out", default=None,
                    help="results file (default results.json, results_quick.json with --quick)")
    args = ap.parse_args(argv)
    args.out = args.out or str(HERE / ("results_quick.json" if args.quick else "results.json"))
    return args


def main():
    args = parse_args()
    names = args.setups or (["demo"] if args.quick else list(SETUPS))
    repeats = args.repeats or (3 if args.quick else 7)
    min_time = 0.5 if args.quick else 3.0
    results = {"jax": jax.__version__, "backend": jax.default_backend(),
               "device": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(),
               "machine": platform.machine(), "quick": args.quick, "setups": {}}
    for name in names:
        r = run_setup(SETUPS[name], repeats, min_time)
        results["setups"][name] = r
        for key, ms in r["median_ms"].items():
            print(f"{name:9s} {key:16s} median {ms:9.2f} ms  min {r['min_ms'][key]:9.2f} ms  "
                  f"compile {r['compile_ms'][key]:8.0f} ms", flush=True)
        for key, v in r["ratios"].items():
            print(f"{name:9s} {key}: draft/decode {v['draft_over_decode']:.2f}, "
                  f"draft/verify {v['draft_over_verify']:.3f}", flush=True)
        for key, v in r["per_layer"].items():
            print(f"{name:9s} {key:13s} per layer {v['per_layer_ms']:8.2f} ms, "
                  f"depth-independent {v['depth_independent_ms']:8.2f} ms", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
