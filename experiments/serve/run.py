"""Load on ``tev-jax serve`` (issue 52): tokens/s, time to first token and inter-token
latency at concurrency 1 .. 32, tree decoding against AR, on loopback.

For each method (DDTree + TEV at a fixed budget, and ``--builder none``, plain AR) one
server is started on 127.0.0.1 with the bundled models (max batch 32, ``--warmup``: every
program of the greedy lane compiled before it listens). Each level sends ``max(c, 8)``
requests from the
bundled prompt sets (gsm, humaneval, mt_bench, math, in turn; cut to 128 tokens) through
``c`` concurrent streaming clients (the ``openai`` package), greedy, ``--max-tokens``
each. Per level:

- output tokens/s: completion tokens of the level / its wall time;
- TTFT: time from sending a request to its first text (median, p90);
- ITL: per request, (last text - first text) / (completion tokens - 1) (median, p90);
- τ: block tokens / row rounds of the level's finished requests (from ``GET /health``);
- budget: the budgets the level's rounds ran with (``GET /health``).

Every request is checked: its stream's completion tokens are the usage's, and at T = 0
the tree server's text equals the AR server's for the same prompt.

    python experiments/serve/run.py            # -> results.json, serve.png, README table
    python experiments/serve/run.py --quick    # levels 1, 4, 16; 16 tokens
"""

from __future__ import annotations

from tev_jax.runtime.platforms import quiet_start

if __name__ == "__main__":
    quiet_start()  # before jax is imported: no libtpu or CUDA plugin lines on a CPU

import argparse
import concurrent.futures
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

LEVELS = (1, 2, 4, 8, 16, 32)
MODEL = "tev-jax-bundled"


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else None


def _prompts(n: int) -> list[str]:
    from tev_jax.data.prompts import prompt_set
    from tev_jax.data.tokenizer import load_default_tokenizer

    tok = load_default_tokenizer()
    sets = [prompt_set(s) for s in ("gsm", "humaneval", "mt_bench", "math")]
    texts = []
    for i in range(n):
        t = sets[i % 4][(i // 4) % len(sets[i % 4])]
        while len(tok.encode(t).ids) > 128:
            t = t[: len(t) * 3 // 4]
        texts.append(t)
    return texts


def _stream(client, text: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = last = None
    pieces, usage = [], None
    for chunk in client.completions.create(model=MODEL, prompt=text, max_tokens=max_tokens,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].text:
            now = time.perf_counter()
            first = first or now
            last = now
            pieces.append(chunk.choices[0].text)
    n = usage.completion_tokens
    return {"text": "".join(pieces), "tokens": n,
            "ttft": (first or time.perf_counter()) - t0,
            "itl": (last - first) / (n - 1) if first and n > 1 else None}


def _level(server, client, c: int, texts: list[str], max_tokens: int) -> dict:
    before = server.health()
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(c) as pool:
        rows = list(pool.map(lambda t: _stream(client, t, max_tokens), texts, timeout=1800))
    wall = time.perf_counter() - t0
    after = server.wait_idle()
    rounds = after["row_rounds"] - before["row_rounds"]
    budgets = {k: v - before["budgets"].get(k, 0) for k, v in after["budgets"].items()
               if v > before["budgets"].get(k, 0)}
    ttft = [r["ttft"] for r in rows]
    itl = [r["itl"] for r in rows if r["itl"] is not None]
    return {"concurrency": c, "requests": len(rows), "seconds": wall,
            "tokens": sum(r["tokens"] for r in rows),
            "tokens_per_s": sum(r["tokens"] for r in rows) / wall,
            "ttft_p50": statistics.median(ttft), "ttft_p90": _pct(ttft, 0.9),
            "itl_p50": statistics.median(itl) if itl else None, "itl_p90": _pct(itl, 0.9),
            "tau": (after["block_tokens"] - before["block_tokens"]) / rounds if rounds else None,
            "budgets": budgets, "slots_free_after": after["slots_free"],
            "texts": [r["text"] for r in rows]}


def run(args) -> dict:
    from test_server import Server

    levels = (1, 4, 16) if args.quick else LEVELS
    max_tokens = 16 if args.quick else args.max_tokens
    results = {"max_tokens": max_tokens, "max_batch": 32, "methods": {}}
    methods = {f"ddtree b{args.budget} + tev": ["--budget", str(args.budget)],
               "AR": ["--builder", "none"]}
    for name, flags in methods.items():
        t0 = time.perf_counter()
        server = Server(*flags, "--max-batch", "32", "--max-tokens", str(max_tokens),
                        "--max-prompt-tokens", "128", "--max-queue", "128",
                        "--warmup", wait_s=900)
        startup = time.perf_counter() - t0
        try:
            client = server.client()
            _level(server, client, 2, _prompts(2), 4)  # the HTTP path (--warmup compiled)
            rows = []
            for c in levels:
                row = _level(server, client, c, _prompts(max(c, 8)), max_tokens)
                print(f"[{name}] c={c}: {row['tokens_per_s']:.1f} tok/s, ttft p50 "
                      f"{row['ttft_p50'] * 1e3:.0f} ms, itl p50 "
                      f"{(row['itl_p50'] or 0) * 1e3:.1f} ms, tau {row['tau']}",
                      file=sys.stderr)
                rows.append(row)
        finally:
            code = server.stop()
        results["methods"][name] = {"flags": flags, "levels": rows, "exit_code": code,
                                    "startup_seconds": startup}
    tree, ar = results["methods"].values()
    results["same_text_as_ar"] = all(
        a["texts"] == b["texts"] for a, b in zip(tree["levels"], ar["levels"]))
    for m in results["methods"].values():
        for row in m["levels"]:
            row.pop("texts")
    return results


def table(results: dict) -> str:
    lines = ["| method | c | requests | tokens/s | TTFT p50 / p90 (ms) | ITL p50 / p90 (ms) "
             "| τ | budget: rounds | slots free after |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    ms = lambda x: "-" if x is None else f"{x * 1e3:.0f}"
    ms1 = lambda x: "-" if x is None else f"{x * 1e3:.1f}"
    for name, m in results["methods"].items():
        for r in m["levels"]:
            budgets = ", ".join(f"{'AR' if k == '0' else k}: {v}" for k, v in r["budgets"].items())
            tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
            lines.append(f"| {name} | {r['concurrency']} | {r['requests']} | "
                         f"{r['tokens_per_s']:.1f} | {ms(r['ttft_p50'])} / {ms(r['ttft_p90'])} | "
                         f"{ms1(r['itl_p50'])} / {ms1(r['itl_p90'])} | {tau} | {budgets} | "
                         f"{r['slots_free_after']} |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for name, m in results["methods"].items():
        c = [r["concurrency"] for r in m["levels"]]
        axes[0].plot(c, [r["tokens_per_s"] for r in m["levels"]], "o-", label=name)
        axes[1].plot(c, [r["ttft_p50"] * 1e3 for r in m["levels"]], "o-", label=name)
        axes[2].plot(c, [(r["itl_p50"] or 0) * 1e3 for r in m["levels"]], "o-", label=name)
    for ax, title in zip(axes, ("output tokens/s", "time to first token, median (ms)",
                                "inter-token latency, median (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("tev-jax serve, bundled models on this CPU (loopback)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", default=str(HERE / "results.json"))
    args = p.parse_args()
    results = run(args)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    if not args.quick:
        plot(results, HERE / "serve.png")
    print(table(results))
    print(f"same text as AR at every level: {results['same_text_as_ar']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
