"""CPU decode speed of the bundled models: this checkout against an earlier commit.

Checks out ``--base`` into a temporary git worktree, starts one worker process per
version (each compiles the same fused generation as `cpu_speed.py`: bundled target and
ExitTrain drafter, B 4, budget 32, TEV, 96 new tokens), then times them round-robin, one
generation at a time, so load drift hits both alike. Prints the median times, their ratio
and the median of the per-repeat ratios, and whether both produced the same tokens.

    python experiments/round_bytes/cpu_speed_base.py --base 01c91c2 [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

WORKER = r'''
import hashlib, json, sys, time
import jax, numpy as np
from tev_jax.data.prompts import prompt_set
from tev_jax.decode import LEN_ALIGN, DecodeConfig
from tev_jax.engine import Engine
from tev_jax.models.bundled import load_bundled
from tev_jax.sampling import Sampling

batch, temperature = int(sys.argv[1]), float(sys.argv[2])
target, drafter, tok = load_bundled()
ids = [tok.encode(p).ids for p in prompt_set("humaneval")[:batch]]
config = DecodeConfig(budget=32, verifier="tev", max_new_tokens=96,
                      sampling=Sampling(temperature=temperature))
width = -(-max(len(x) for x in ids) // LEN_ALIGN) * LEN_ALIGN
engine = Engine.create(target, drafter, config, len(ids), prompt_len=width)
prompts = engine.prompts(ids)
t0 = time.perf_counter()
exe = engine.lower("generate").compile()
compile_s = time.perf_counter() - t0
args = (engine.params, prompts.tokens_BT, prompts.lengths_B, jax.random.key(0))
out = jax.block_until_ready(exe(*args))
digest = hashlib.sha256(np.asarray(out.out_BM).tobytes()).hexdigest()[:16]
print(json.dumps({"ready": True, "compile_s": compile_s, "tokens": digest}), flush=True)
for line in sys.stdin:
    if line.strip() != "run":
        break
    t0 = time.perf_counter()
    jax.block_until_ready(exe(*args))
    print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)
'''


def start(path: Path, batch: int, temperature: float) -> tuple[subprocess.Popen, dict]:
    env = dict(os.environ, PYTHONPATH=str(path), JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(batch), str(temperature)],
                            cwd=path, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    return proc, json.loads(proc.stdout.readline())


def run_once(proc: subprocess.Popen) -> float:
    proc.stdin.write("run\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())["seconds"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the commit to compare against")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args(argv)
    tree = Path(tempfile.mkdtemp(prefix="tev_base_"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree),
                    args.base], check=True, capture_output=True)
    procs = {}
    try:
        for name, path in (("base", tree), ("this", ROOT)):   # compiled one after the other
            procs[name], info = start(path, args.batch, args.temperature)
            print(f"{name}: compiled in {info['compile_s']:.1f} s, tokens {info['tokens']}")
            procs[name].info = info
        times = {name: [] for name in procs}
        for _ in range(args.repeats):
            for name, proc in procs.items():
                times[name].append(run_once(proc))
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                       capture_output=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    paired = statistics.median(a / b for a, b in zip(times["this"], times["base"]))
    same = procs["base"].info["tokens"] == procs["this"].info["tokens"]
    print(f"same tokens: {same}")
    for name in procs:
        print(f"{name:<5} median {med[name] * 1e3:8.1f} ms over {args.repeats} runs")
    print(f"time this / base = {med['this'] / med['base']:.3f} "
          f"(median of per-repeat ratios {paired:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
