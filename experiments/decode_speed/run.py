"""Decode speed: AR vs chain vs DDTree + predraw vs DDTree + TEV, with τ and stage shares.

Everything runs in one process on the same models, batch 1, float32:

1. **Fused** (`tev_jax.decode.compiled_generate`: the whole generation is one jitted
   ``lax.while_loop``; every configuration is compiled first, then all are timed
   round-robin ``--repeats`` times, so that load drift on a shared machine hits them
   alike; medians): tokens/s and τ of plain autoregressive decoding (AR), the DFlash chain
   (verified by TEV) and DDTree trees of each budget verified by predraw and by TEV, at
   T = 0 and T = 1, with the DFlash drafter. Speed-ups are against the AR run of the same
   temperature.
2. **Un-fused** (`tev_jax.decode.profile_generate`: every stage jitted separately and
   timed with ``block_until_ready``, after a warm-up pass; one run per configuration;
   each stage call includes a dispatch overhead, measured and recorded): per-stage seconds (prefill,
   draft, build, verify, decide, commit) and τ, for the DFlash drafter and for the oracle
   drafter (`tev_jax.decode_drafters.OracleDrafter`, which drafts with the target's own
   greedy chain: τ is meaningful, but its draft stage costs H target decode steps).
   From these, a *projection*: the tokens/s of the oracle's trees if drafting cost what
   the DFlash drafter's draft stage costs (oracle's non-draft stages + oracle rounds x
   DFlash draft time per round), against the un-fused AR run.

Models. By default a random target shaped like the demo target of
``train/train_target.py`` (D = 256, 6 layers, 4 / 2 heads of 64, MLP 768, V = 4096) but
with an untied LM head scaled by ``--head-scale`` (a random head gives near-uniform
next-token distributions, under which nothing is ever accepted at T = 1), and a random
1-layer DFlash drafter with block size 16; the prompt is random token ids. With
``--target DIR [--drafter DIR]`` the checkpoints are loaded instead and the prompt is the
first HumanEval prompt, tokenized with the target's tokenizer.

    python experiments/decode_speed/run.py            # -> results.json
    python experiments/decode_speed/run.py --quick    # tiny model, 2 budgets -> results_quick.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tev_jax import decode
from tev_jax.decode_drafters import OracleDrafter
from tev_jax.models import ModelConfig, init_drafter, init_target, load_drafter, load_target
from tev_jax.sampling import Sampling

HERE = Path(__file__).resolve().parent
STAGES = ("prefill", "draft", "build", "verify", "decide", "commit")


def random_models(args):
    if args.quick:
        cfg = ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=64,
                          intermediate_size=192, num_layers=2, num_heads=4, num_kv_heads=2,
                          head_dim=16, qk_norm=True)
    else:
        cfg = ModelConfig(model_type="qwen3", vocab_size=4096, hidden_size=256,
                          intermediate_size=768, num_layers=6, num_heads=4, num_kv_heads=2,
                          head_dim=64, qk_norm=True, max_position_embeddings=2048)
    target = init_target(cfg, key=0)
    target.lm_head[...] = target.lm_head[...] * args.head_scale
    drafter = init_drafter(target, num_layers=1, block_size=args.block_size,
                           mask_token_id=cfg.vocab_size - 1, key=1)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size - 1, args.prompt_len).tolist()
    return target, drafter, prompt, "random"


def loaded_models(args):
    from tev_jax.data.prompts import prompt_set
    from tev_jax.models import load_tokenizer

    target = load_target(args.target)
    if args.drafter:
        drafter = load_drafter(args.drafter, target)
    else:
        drafter = init_drafter(target, num_layers=1, block_size=args.block_size,
                               mask_token_id=target.config.vocab_size - 1, key=1)
    prompt = load_tokenizer(args.target).encode(prompt_set("humaneval")[0]).ids
    return target, drafter, prompt, f"{args.target} + {args.drafter or 'random drafter'}"


def configs(budgets, temperature, max_new):
    sampling = Sampling(temperature=temperature)
    base = decode.DecodeConfig(max_new_tokens=max_new, sampling=sampling)
    out = [("AR", dataclasses.replace(base, builder="none")),
           ("chain+tev", dataclasses.replace(base, builder="chain", verifier="tev"))]
    for b in budgets:
        for v in ("predraw", "tev"):
            out.append((f"ddtree{b}+{v}", dataclasses.replace(base, builder="ddtree",
                                                              budget=b, verifier=v)))
    return out


def entropy_nats(target, prompt, temperature):
    """Entropy of the target's first next-token distribution (how peaked it is)."""
    if temperature == 0:
        return 0.0
    logits = target(jnp.asarray([prompt], jnp.int32))[0][0, -1] / temperature
    p = jax.nn.softmax(logits)
    return float(-(p * jax.nn.log_softmax(logits)).sum())


def dispatch_seconds(target, drafter, prompt, max_new, repeats=200):
    """Median wall time of a jitted no-op over the un-fused path's arguments (params and
    decode state): the dispatch overhead included in every un-fused stage time."""
    cfg = decode.DecodeConfig(max_new_tokens=max_new, builder="chain")
    graphdef, params, tokens_BT, lengths_B, static = decode._prepare(target, drafter, [prompt], cfg)
    st = decode._stage_fns(static, graphdef)["prefill"](params, tokens_BT, lengths_B,
                                                        jax.random.key(0))
    noop = jax.jit(lambda params, st: st.round)
    jax.block_until_ready(noop(params, st))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(noop(params, st))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--target", default=None)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--budgets", type=int, nargs="+", default=None)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--head-scale", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    budgets = args.budgets or ([16, 64] if args.quick else [16, 32, 64, 128])
    max_new = args.max_new_tokens or (32 if args.quick else 128)
    repeats = args.repeats or (1 if args.quick else 3)
    out_path = Path(args.out) if args.out else HERE / (
        "results_quick.json" if args.quick else "results.json")

    target, drafter, prompt, models = (loaded_models(args) if args.target
                                       else random_models(args))
    oracle = OracleDrafter(drafter.config.block_size)
    print(f"models: {models}; target {target.config.num_params / 1e6:.1f} M params, "
          f"V = {target.config.vocab_size}, H = {drafter.config.block_size - 1}, "
          f"prompt {len(prompt)} tokens, {max_new} new tokens", flush=True)

    runs = []
    t_start = time.time()
    dispatch = dispatch_seconds(target, drafter, prompt, max_new)
    print(f"un-fused dispatch overhead per stage call: {dispatch * 1e3:.2f} ms", flush=True)
    # 1. fused tokens/s with the DFlash drafter: compile everything, then time round-robin
    fused = {}
    for temp in args.temperatures:
        for name, cfg in configs(budgets, temp, max_new):
            t0 = time.perf_counter()
            fused[temp, name] = decode.compiled_generate(
                target, None if cfg.builder == "none" else drafter, [prompt], cfg, key=0)
            print(f"compiled T={temp} {name} in {time.perf_counter() - t0:.1f} s", flush=True)
    times = {k: [] for k in fused}
    gens = {}
    for _ in range(repeats):
        for k, run in fused.items():
            gens[k] = run()
            times[k].append(gens[k].stats.seconds)
    for temp in args.temperatures:
        ent = entropy_nats(target, prompt, temp)
        ar_speed = None
        for name, _ in configs(budgets, temp, max_new):
            gen, secs = gens[temp, name], float(np.median(times[temp, name]))
            n = int(gen.lengths[0])
            speed = n / secs
            ar_speed = speed if name == "AR" else ar_speed
            row = dict(path="fused", drafter="dflash", temperature=temp, config=name,
                       tokens=n, seconds=secs, seconds_all=times[temp, name],
                       tokens_per_s=speed, speedup_vs_ar=speed / ar_speed, tau=gen.stats.tau,
                       rounds=gen.stats.rounds, entropy_first_step=ent)
            runs.append(row)
            print(f"T={temp} fused dflash {name:16s} {speed:8.1f} tok/s  "
                  f"x{row['speedup_vs_ar']:.2f}  tau {row['tau']:.2f}", flush=True)

    # 2. un-fused stage times, DFlash and oracle drafters (one warmed-up run each)
    for temp in args.temperatures:
        for dname, d in (("dflash", drafter), ("oracle", oracle)):
            for name, cfg in configs(budgets, temp, max_new):
                if name == "AR" and dname == "oracle":
                    continue
                gen = decode.profile_generate(target, None if cfg.builder == "none" else d,
                                              [prompt], cfg, key=0)
                st = gen.stats.stage_seconds
                total = sum(st.values())
                runs.append(dict(path="unfused", drafter=dname, temperature=temp, config=name,
                                 tokens=int(gen.lengths[0]), seconds=gen.stats.seconds,
                                 tau=gen.stats.tau, rounds=gen.stats.rounds,
                                 stage_seconds=st,
                                 stage_shares={k: v / total for k, v in st.items()}))
                print(f"T={temp} unfused {dname:6s} {name:16s} tau {gen.stats.tau:5.2f}  "
                      + " ".join(f"{k} {v * 1e3:7.1f}ms" for k, v in st.items()), flush=True)

    # 3. projection: oracle trees at the DFlash drafter's drafting cost (un-fused times)
    def find(**kw):
        return next(r for r in runs if all(r.get(k) == v for k, v in kw.items()))

    projections = []
    for temp in args.temperatures:
        ar = find(path="unfused", drafter="dflash", temperature=temp, config="AR")
        ar_speed = ar["tokens"] / sum(ar["stage_seconds"].values())
        for name, _ in configs(budgets, temp, max_new)[1:]:
            o = find(path="unfused", drafter="oracle", temperature=temp, config=name)
            dfl = find(path="unfused", drafter="dflash", temperature=temp, config=name)
            draft_per_round = dfl["stage_seconds"]["draft"] / dfl["rounds"]
            secs = (sum(v for k, v in o["stage_seconds"].items() if k != "draft")
                    + o["rounds"] * draft_per_round)
            projections.append(dict(temperature=temp, config=name, tau_oracle=o["tau"],
                                    projected_tokens_per_s=o["tokens"] / secs,
                                    unfused_ar_tokens_per_s=ar_speed,
                                    projected_speedup=o["tokens"] / secs / ar_speed))

    result = dict(
        setup=dict(models=models, target_params=target.config.num_params,
                   vocab=target.config.vocab_size, horizon=drafter.config.block_size - 1,
                   drafter_layers=drafter.config.num_layers, prompt_len=len(prompt),
                   max_new_tokens=max_new, budgets=budgets, temperatures=args.temperatures,
                   head_scale=None if args.target else args.head_scale, repeats=repeats,
                   batch=1, dtype="float32"),
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(),
                     jax=jax.__version__, backend=jax.default_backend(),
                     load_average=os.getloadavg()),
        total_seconds=time.time() - t_start,
        unfused_dispatch_seconds_per_call=dispatch,
        runs=runs,
        projections=projections,
    )
    out_path.write_text(json.dumps(result, indent=1))
    print(f"wrote {out_path} ({result['total_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
