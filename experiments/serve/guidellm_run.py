"""``tev-jax serve`` measured by a client nobody here wrote: GuideLLM (issue 59, item 4).

For each method (DDTree budget 16 + TEV, and ``--builder none``, plain AR) one server is
started on 127.0.0.1 with the bundled models (``--max-batch 32 --warmup``: every program
compiled before it listens), and GuideLLM (`guidellm run`, the vLLM project's benchmark
client) drives it at concurrency 1, 2, 4, 8, 16 and 32: its ``concurrent`` profile, its
synthetic text (64 prompt tokens, 32 output tokens, counted with the bundled tokenizer,
which it loads offline from the bundle), streaming completions at the OpenAI clients'
default temperature 1, ``max(2c, 16)`` requests a level. From GuideLLM's JSON report:
output tokens/s, time to first token and inter-token latency (median, p90); from the
server's ``GET /metrics`` before and after each level: the mean acceptance length
``1 + accepted / drafts`` (vLLM's counters).

GuideLLM pins its own dependencies (transformers, pydantic, ...), so it runs from a
virtual environment of its own::

    python -m venv /tmp/gllm && /tmp/gllm/bin/pip install guidellm==0.8.1
    python experiments/serve/guidellm_run.py --guidellm /tmp/gllm/bin/guidellm
    python experiments/serve/guidellm_run.py --guidellm ... --quick   # levels 1, 4, 16

-> ``results_guidellm.json`` and the README's table.
"""

from __future__ import annotations

from tev_jax.runtime.platforms import quiet_start

if __name__ == "__main__":
    quiet_start()  # before jax is imported: no libtpu or CUDA plugin lines on a CPU

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

LEVELS = (1, 2, 4, 8, 16, 32)
PROMPT_TOKENS, OUTPUT_TOKENS = 64, 32
MARK = ("<!-- guidellm -->", "<!-- /guidellm -->")


def _spec_counters(server) -> tuple[float, float]:
    """(drafts, accepted draft tokens) so far, from the server's ``GET /metrics``."""
    from test_server import _metrics, _sum

    m = _metrics(server)
    return (_sum(m, "vllm:spec_decode_num_drafts_total"),
            _sum(m, "vllm:spec_decode_num_accepted_tokens_total"))


def _stat(metric: dict, key: str) -> float | None:
    """A statistic of GuideLLM's distribution summary of the successful requests."""
    s = metric["successful"]
    return s["percentiles"][key] if key.startswith("p") else s[key]


def _level(guidellm: str, server, c: int, out: Path) -> dict:
    target = str(ROOT / "tev_jax" / "data" / "models" / "target")
    argv = [guidellm, "run", "--backend", f"kind=openai_http,target={server.url}",
            "--profile", f"kind=concurrent,streams={c}",
            "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
                      f"output_tokens={OUTPUT_TOKENS}",
            "--tokenizer", f"kind=hf_auto,model={target}",
            "--constraint", f"kind=max_requests,count={max(2 * c, 16)}",
            "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    before = _spec_counters(server)
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"guidellm failed ({done.returncode}):\n{done.stderr[-3000:]}")
    after = _spec_counters(server)
    bench = json.loads(out.read_text())["benchmarks"][0]
    m = bench["metrics"]
    drafts, accepted = (a - b for a, b in zip(after, before))
    return {"c": c, "seconds": time.perf_counter() - t0,
            "requests": int(m["request_totals"]["successful"]),
            "errored": int(m["request_totals"]["errored"]),
            "tokens_per_s": _stat(m["output_tokens_per_second"], "mean"),
            "ttft_p50_ms": _stat(m["time_to_first_token_ms"], "median"),
            "ttft_p90_ms": _stat(m["time_to_first_token_ms"], "p90"),
            "itl_p50_ms": _stat(m["inter_token_latency_ms"], "median"),
            "itl_p90_ms": _stat(m["inter_token_latency_ms"], "p90"),
            "drafts": drafts, "accepted": accepted,
            "acceptance_length": 1 + accepted / drafts if drafts else None}


def run(args) -> dict:
    from test_server import Server

    levels = (1, 4, 16) if args.quick else LEVELS
    methods = {"ddtree b16 + tev": ["--budget", "16"], "AR": ["--builder", "none"]}
    results = {"client": f"guidellm ({args.guidellm})", "prompt_tokens": PROMPT_TOKENS,
               "output_tokens": OUTPUT_TOKENS, "max_batch": 32, "methods": {}}
    version = subprocess.run([args.guidellm, "--version"], capture_output=True, text=True)
    results["client"] = version.stdout.strip() or results["client"]
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in methods.items():
            server = Server(*flags, "--max-batch", "32", "--max-tokens", str(OUTPUT_TOKENS + 8),
                            "--max-prompt-tokens", "128", "--max-queue", "128", "--warmup",
                            wait_s=1200)
            try:
                rows = []
                for c in levels:
                    row = _level(args.guidellm, server, c, Path(tmp) / f"{len(rows)}.json")
                    print(f"[{name}] c={c}: {row['tokens_per_s']:.1f} tok/s, ttft p50 "
                          f"{row['ttft_p50_ms']:.0f} ms, itl p50 {row['itl_p50_ms']:.1f} ms, "
                          f"acceptance length {row['acceptance_length']}", file=sys.stderr)
                    rows.append(row)
            finally:
                code = server.stop()
            results["methods"][name] = {"flags": flags, "levels": rows, "exit_code": code}
    return results


def table(results: dict) -> str:
    lines = ["| method | c | requests (errors) | output tokens/s | TTFT p50 / p90 (ms) | "
             "ITL p50 / p90 (ms) | acceptance length (/metrics) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, m in results["methods"].items():
        for r in m["levels"]:
            length = "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
            lines.append(f"| {name} | {r['c']} | {r['requests']} ({r['errored']}) | "
                         f"{r['tokens_per_s']:.1f} | {r['ttft_p50_ms']:.0f} / "
                         f"{r['ttft_p90_ms']:.0f} | {r['itl_p50_ms']:.1f} / "
                         f"{r['itl_p90_ms']:.1f} | {length} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--guidellm", default="guidellm", help="the guidellm executable")
    ap.add_argument("--quick", action="store_true", help="levels 1, 4, 16 only")
    args = ap.parse_args()
    results = run(args)
    (HERE / ("results_guidellm_quick.json" if args.quick else "results_guidellm.json")
     ).write_text(json.dumps(results, indent=1) + "\n")
    text = table(results)
    print(text)
    if not args.quick:
        readme = HERE / "README.md"
        body = readme.read_text()
        if MARK[0] in body:
            body = re.sub(f"{re.escape(MARK[0])}.*?{re.escape(MARK[1])}",
                          f"{MARK[0]}\n{text}\n{MARK[1]}", body, flags=re.S)
            readme.write_text(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
