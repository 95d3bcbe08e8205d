"""Eight sampling settings in one batch against one (issue 59, item 2).

The server's scheduler in process (no HTTP), bundled models, ``--max-batch 8``, a fixed
budget, every program compiled first (``warmup``). A wave is 8 seeded requests of 32
tokens sent together; the waves alternate between three mixes, ``--repeats`` times
each, and the script prints each mix's median wall time and its ratio to the others
(one run, so the machine's noise hits all mixes alike):

- ``one plain``: 8 x temperature 1 (no top-k / top-p: no cut);
- ``eight plain``: 8 temperatures, greedy to 1.5 (no cut);
- ``one top-k``: 8 x temperature 1, top-k 20 (the cut among the 256 largest logits);
- ``one top-p``: 8 x temperature 0.8, top-p 0.9 (the bundled target's nucleus at T 0.8
  often reaches past its 256 largest logits: then the round sorts the vocabulary);
- ``eight mixed``: 8 different settings (greedy, plain temperatures, top-k, top-p).

    python experiments/serve/settings.py [--repeats 5] [--json results_settings.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from tev_jax.runtime.platforms import quiet_start

MIXES = {
    "one plain": [(1.0, None, None)] * 8,
    "eight plain": [(t, None, None) for t in (0.0, 0.3, 0.5, 0.7, 0.9, 1.0, 1.2, 1.5)],
    "one top-k": [(1.0, 20, None)] * 8,
    "one top-p": [(0.8, None, 0.9)] * 8,
    "eight mixed": [(0.0, None, None), (0.5, None, None), (1.0, None, None),
                    (1.3, None, None), (1.0, 5, None), (0.7, None, 0.8),
                    (1.0, 20, 0.95), (0.9, 3, None)],
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    quiet_start()
    from tev_jax.data.tokenizer import STOP_IDS
    from tev_jax.decode import DecodeConfig
    from tev_jax.models.bundled import load_bundled
    from tev_jax.sampling import Sampling
    from tev_jax.server.requests import GenerationRequest
    from tev_jax.server.scheduler import Scheduler

    target, drafter, tok = load_bundled()
    config = DecodeConfig(max_new_tokens=args.max_tokens, prompt_len=64, budget=16,
                          stop_token_ids=STOP_IDS)
    s = Scheduler(target, drafter, config, tok.decode, max_batch=8, widths=[64])
    t0 = time.perf_counter()
    s.warmup()
    print(f"warm-up: {time.perf_counter() - t0:.0f} s")
    s.start()
    prompt = tuple(tok.encode("Once upon a time there was a little robot who").ids)

    def wave(mix: str, seed: int) -> tuple[float, int]:
        done, lock, ended, tokens = threading.Event(), threading.Lock(), [0], [0]

        def emit(event):
            with lock:
                tokens[0] += len(event.token_ids)
                if event.finish_reason is not None:
                    ended[0] += 1
                    if ended[0] == 8:
                        done.set()

        start = time.perf_counter()
        for i, (t, k, p) in enumerate(MIXES[mix]):
            s.submit(GenerationRequest(chat=False, prompt_ids=prompt,
                                       max_tokens=args.max_tokens, sampling=Sampling(t, k, p),
                                       seed=seed * 8 + i), emit)
        assert done.wait(600), s.snapshot()
        return time.perf_counter() - start, tokens[0]

    for mix in MIXES:  # one untimed wave each
        wave(mix, 0)
    times = {mix: [] for mix in MIXES}
    tokens = {mix: [] for mix in MIXES}
    for r in range(args.repeats):
        for mix in MIXES:
            seconds, n = wave(mix, r + 1)
            times[mix].append(seconds)
            tokens[mix].append(n)
    s.drain()
    s.join(60)
    medians = {mix: statistics.median(v) for mix, v in times.items()}
    print(f"{'mix':<12} {'median s':>9} {'tokens/s':>9} {'vs one plain':>13}")
    for mix, m in medians.items():
        rate = statistics.median(n / t for n, t in zip(tokens[mix], times[mix]))
        print(f"{mix:<12} {m:9.3f} {rate:9.1f} {m / medians['one plain']:13.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": times, "tokens": tokens, "medians": medians,
                       "repeats": args.repeats, "max_tokens": args.max_tokens}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
