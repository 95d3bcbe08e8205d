"""Decode speed: AR vs chain vs DDTree + predraw vs DDTree + TEV, with τ and stage shares.

Everything runs in one process on the same models, batch 1, float32:

1. **Fused** (`tev_jax.costs.timing.compiled_generate`: the whole generation is one jitted
   ``lax.while_loop``; every configuration is compiled first, then all are timed
   round-robin ``--repeats`` times, so that load drift on a shared machine hits them
   alike; medians): tokens/s and τ of plain autoregressive decoding (AR), the DFlash chain
   (verified by TEV) and DDTree trees of each budget verified by predraw and by TEV, at
   T = 0 and T = 1, with the DFlash drafter. Speed-ups are against the AR run of the same
   temperature.
2. **Un-fused** (`tev_jax.costs.timing.profile_generate`: every stage jitted separately and
   timed with ``block_until_ready``, after a warm-up pass; one run per configuration;
   each stage call includes a dispatch overhead, measured and recorded): per-stage seconds (prefill,
   draft, build, verify, decide, commit) and τ, for the DFlash drafter and for the oracle
   drafter (`tev_jax.testing.drafters.OracleDrafter`, which drafts with the target's own
   greedy chain: τ is meaningful, but its draft stage costs H target decode steps).
   Stage times are medians over rounds (robust to load spikes on a shared machine).
   From these, a *projection*: the tokens/s of the oracle's trees if drafting cost what
   the DFlash drafter's draft stage costs (prefill + oracle rounds x (the oracle run's
   median non-draft stage times + the DFlash run's median draft time)), against the
   un-fused AR run computed the same way.

Models. By default a random target shaped like the demo target of
``train/demo/train_target.py`` (D = 256, 6 layers, 4 / 2 heads of 64, MLP 768, V = 4096) but
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

from tev_jax.runtime.platforms import quiet_start

if __name__ == "__main__":
    quiet_start()  # before jax is imported: no libtpu or CUDA plugin lines on a CPU

import jax
import jax.numpy as jnp
import numpy as np

from tev_jax import decode, engine
from tev_jax.costs import timing
from tev_jax.models import ModelConfig, init_drafter, init_target, load_drafter, load_target
from tev_jax.sampling import Sampling
from tev_jax.testing.drafters import OracleDrafter

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
    eng, prompts = engine.engine_for(target, drafter, [prompt], cfg)
    st, params = eng.prefill(prompts, jax.random.key(0)), eng.params
    noop = jax.jit(lambda params, st: st.round)
    jax.block_until_ready(noop(params, st))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(noop(params, st))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def report(result) -> str:
    """Markdown tables of a results dict (what README.md shows)."""
    runs = result["runs"]
    temps = result["setup"]["temperatures"]
    names = [n for n, _ in configs(result["setup"]["budgets"], 0.0, 1)]
    lines = ["| configuration | " + " | ".join(f"T={t}: tok/s | x AR | tau" for t in temps)
             + " |", "|---|" + "---|---|---|" * len(temps)]
    for name in names:
        cells = []
        for t in temps:
            r = next(r for r in runs if r["path"] == "fused" and r["temperature"] == t
                     and r["config"] == name)
            cells.append(f"{r['tokens_per_s']:.1f} | {r['speedup_vs_ar']:.2f} | {r['tau']:.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    for drafter in ("dflash", "oracle"):
        for t in temps:
            lines.append(f"un-fused, {drafter} drafter, T={t}: tau, median ms per round by "
                         "stage (share of a round); prefill: ms once")
            lines.append("")
            lines.append("| configuration | tau | rounds | " + " | ".join(STAGES) + " |")
            lines.append("|---|---|---|" + "---|" * len(STAGES))
            for name in names:
                r = next((r for r in runs if r["path"] == "unfused" and r["drafter"] == drafter
                          and r["temperature"] == t and r["config"] == name), None)
                if r is None:
                    continue
                med = r["median_round_seconds"]
                per = [f"{med['prefill'] * 1e3:.1f}"] + [
                    f"{med[k] * 1e3:.2f} ({r['round_shares'][k] * 100:.0f}%)" for k in STAGES[1:]]
                lines.append(f"| {name} | {r['tau']:.2f} | {r['rounds']} | "
                             + " | ".join(per) + " |")
            lines.append("")
    lines.append("projection: oracle trees at the DFlash drafter's draft cost (un-fused)")
    lines.append("")
    lines.append("| T | configuration | tau (oracle) | projected tok/s | un-fused AR tok/s "
                 "| projected x AR |")
    lines.append("|---|---|---|---|---|---|")
    for p in result["projections"]:
        lines.append(f"| {p['temperature']} | {p['config']} | {p['tau_oracle']:.2f} | "
                     f"{p['projected_tokens_per_s']:.1f} | {p['unfused_ar_tokens_per_s']:.1f} | "
                     f"{p['projected_speedup']:.2f} |")
    return "\n".join(lines)


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
    ap.add_argument("--report", default=None, metavar="JSON",
                    help="only print the markdown tables of an existing results file")
    args = ap.parse_args()
    if args.report:
        print(report(json.loads(Path(args.report).read_text())))
        return
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
            fused[temp, name] = timing.compiled_generate(
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
                gen = timing.profile_generate(target, None if cfg.builder == "none" else d,
                                              [prompt], cfg, key=0)
                med = {k: float(np.median(v)) for k, v in gen.stats.round_seconds.items()}
                per_round = sum(v for k, v in med.items() if k != "prefill")
                runs.append(dict(path="unfused", drafter=dname, temperature=temp, config=name,
                                 tokens=int(gen.lengths[0]), seconds=gen.stats.seconds,
                                 tau=gen.stats.tau, rounds=gen.stats.rounds,
                                 stage_seconds=gen.stats.stage_seconds,
                                 median_round_seconds=med,
                                 round_shares={k: v / per_round for k, v in med.items()
                                               if k != "prefill"}))
                print(f"T={temp} unfused {dname:6s} {name:16s} tau {gen.stats.tau:5.2f}  "
                      + " ".join(f"{k} {v * 1e3:7.2f}ms" for k, v in med.items()), flush=True)

    # 3. projection: oracle trees at the DFlash drafter's drafting cost (un-fused times)
    def find(**kw):
        return next(r for r in runs if all(r.get(k) == v for k, v in kw.items()))

    projections = []
    for temp in args.temperatures:
        ar = find(path="unfused", drafter="dflash", temperature=temp, config="AR")
        ar_secs = ar["median_round_seconds"]
        ar_speed = ar["tokens"] / (ar_secs["prefill"] + ar["rounds"] * sum(
            v for k, v in ar_secs.items() if k != "prefill"))
        for name, _ in configs(budgets, temp, max_new)[1:]:
            o = find(path="unfused", drafter="oracle", temperature=temp, config=name)
            dfl = find(path="unfused", drafter="dflash", temperature=temp, config=name)
            med = dict(o["median_round_seconds"], draft=dfl["median_round_seconds"]["draft"])
            secs = med["prefill"] + o["rounds"] * sum(v for k, v in med.items() if k != "prefill")
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
    print(report(result))
    print(f"wrote {out_path} ({result['total_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
