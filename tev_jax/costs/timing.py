"""Timing decoding: the fused program end to end, and each stage of a round on its own.

Two paths, both over an `tev_jax.engine.Engine`:

- **fused** (`compiled_generate`, `timed_generate`): the whole generation is one
  program; ``stats.seconds`` is the wall time of the jitted call up to
  ``block_until_ready``. End-to-end tokens/s come from here.
- **streamed** (`streamed_generate`): the prefill and the rounds called one by one
  from the host, which reads every row's tokens after each (what ``tev-jax generate``
  streams to a terminal); the same tokens as the fused path for the same key.
- **un-fused** (`profile_generate`): the same stage functions, each jitted on its own
  (`Engine.stage`) and timed from a Python loop over rounds. Its per-stage seconds are
  the only stage timings; each includes one dispatch, so their sum exceeds the fused
  time. It produces the same tokens as the fused path for the same key.

`compare_methods` times several decoding methods on the same prompts (what
``tev-jax compare`` prints).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from tev_jax import decode
from tev_jax.runtime import signals
from tev_jax.decode import DecodeConfig, DecodeState
from tev_jax.engine import Engine, as_key, engine_for
from tev_jax.generation import Generation
from tev_jax.prompts import Prompts
from tev_jax.trace import RoundRecord, round_record, stack_records


def compiled_generate(target, drafter, prompt_ids, config: DecodeConfig, key=0, *,
                      mesh=None) -> Callable[[], Generation]:
    """Validates and compiles the fused generation once; returns a function that reruns it.

    Each call of the returned function runs the fused generation once and returns its
    `Generation` with ``stats.seconds`` = wall time of the jitted call up to
    ``block_until_ready`` (host checks excluded) and ``stats.compile_seconds`` = the
    first call's. Benchmarks compile every configuration first and then time them
    round-robin. A signal that came during the compile stops it before any timed run
    (`tev_jax.runtime.signals.check`).
    """
    engine, prompts = engine_for(target, drafter, prompt_ids, config, mesh=mesh)
    key = as_key(key)
    t0 = time.perf_counter()
    jax.block_until_ready(engine.generate(prompts, key))
    compile_seconds = time.perf_counter() - t0
    signals.check()  # a Ctrl-C during the compile: nothing more runs

    def run() -> Generation:
        t0 = time.perf_counter()
        st = jax.block_until_ready(engine.generate(prompts, key))
        return engine.finish(st, seconds=time.perf_counter() - t0,
                             compile_seconds=compile_seconds)

    return run


def timed_generate(target, drafter, prompt_ids, config: DecodeConfig, key=0, *,
                   repeats: int = 3, mesh=None) -> Generation:
    """The fused generation after a compile call; ``stats.seconds`` = median over
    ``repeats`` runs, ``stats.compile_seconds`` = the compile call's wall time."""
    run = compiled_generate(target, drafter, prompt_ids, config, key, mesh=mesh)
    gens = []
    for _ in range(max(repeats, 1)):
        signals.check()
        gens.append(run())
    seconds = float(np.median([g.stats.seconds for g in gens]))
    return dataclasses.replace(gens[-1], stats=dataclasses.replace(gens[-1].stats,
                                                                   seconds=seconds))


def streamed_generate(target, drafter, prompt_ids, config: DecodeConfig, key=0, *,
                      on_round: Callable[[list[list[int]]], None], mesh=None) -> Generation:
    """The generation round by round from the host, for streaming its tokens.

    First a prefill and one round on the same prompts compile the two programs (their
    result is dropped); then the prefill and the rounds run again, and after the prefill
    and after every round ``on_round`` gets every row's tokens so far (lists of ints).
    The rounds are the fused loop's, so the tokens equal `timed_generate`'s for the same
    key. ``stats.compile_seconds`` = the compiling pass, ``stats.seconds`` = the
    streamed pass (one host round trip per round included, the callbacks too).
    """
    engine, prompts = engine_for(target, drafter, prompt_ids, config, mesh=mesh)
    key = as_key(key)
    t0 = time.perf_counter()
    jax.block_until_ready(engine.round(engine.prefill(prompts, key)))
    compile_seconds = time.perf_counter() - t0
    signals.check()  # a Ctrl-C during the compile: no token is shown
    t0 = time.perf_counter()
    st = engine.prefill(prompts, key)
    while True:
        signals.check()  # between rounds
        num_B, done_B, out_BM, rounds = jax.device_get(
            (st.num_out_B, st.done_B, st.out_BM, st.round))
        on_round([row[:n].tolist() for row, n in zip(out_BM, num_B)])
        if done_B.all() or rounds >= config.max_new_tokens:
            break
        st = engine.round(st)
    return engine.finish(st, seconds=time.perf_counter() - t0,
                         compile_seconds=compile_seconds)


def profile_generate(target, drafter, prompt_ids, config: DecodeConfig, key=0, *,
                     warmup: bool = True, mesh=None, trace: bool = False) -> Generation:
    """The un-fused path: every stage jitted separately and timed per round.

    Runs the same stage functions as the fused loop, so it produces the same tokens for
    the same key. A stage is compiled once per setting of the config fields it reads
    (changing the verifier recompiles only the decide stage). ``stats.stage_seconds``
    holds each stage's wall time up to ``block_until_ready``, summed over rounds;
    ``stats.round_seconds`` the per-round times. With ``warmup`` a first pass over the
    prefill and the first round compiles every stage before anything is timed (without
    it the times include compilation). ``mesh`` as in `tev_jax.engine.generate`. With
    ``trace`` the stages' trees and verdicts are also recorded per round
    (``Generation.trace``, `tev_jax.trace.RoundTrace`; recording is not timed).
    """
    engine, prompts = engine_for(target, drafter, prompt_ids, config, mesh=mesh)
    records = [] if trace else None
    st, times, seconds = _profile(engine, prompts, as_key(key), warmup, records)
    rounds = {k: np.asarray(v) for k, v in times.items()}
    return engine.finish(st, stage_seconds={k: float(v.sum()) for k, v in rounds.items()},
                         round_seconds=rounds, seconds=seconds,
                         trace=None if records is None else stack_records(records))


_round_step_keys = jax.jit(decode.round_step_keys)
_round_record = jax.jit(round_record)


def _profile(engine: Engine, prompts: Prompts, key, warmup: bool,
             records: list[RoundRecord] | None = None
             ) -> tuple[DecodeState, dict[str, list[float]], float]:
    """(final state, stage -> per-round seconds, wall seconds of prefill + rounds); the
    timed rounds' records are appended to ``records`` when given."""
    stage = {name: engine.stage(name) for name in ("draft", "build", "verify", "decide",
                                                   "commit")}
    params = engine.params
    times: dict[str, list[float]] = {k: [] for k in ("prefill", *stage)}

    def one_round(st, record: bool):
        def timed(name, *args):
            t0 = time.perf_counter()
            out = jax.block_until_ready(stage[name](*args))
            if record:
                times[name].append(time.perf_counter() - t0)
            return out

        if engine.spec.has_drafter:
            draft_logits, ctx = timed("draft", params, st)
        else:
            draft_logits, ctx = None, st.ctx
            if record:
                times["draft"].append(0.0)
        tree = timed("build", draft_logits, st.root_B)
        logits, feats, cache, experts = timed("verify", params, st.cache, tree, st.start_B)
        verdict = timed("decide", _round_step_keys(st), tree, logits)
        if record and records is not None:
            records.append(_round_record(st.start_B, st.done_B, draft_logits, tree, logits,
                                             verdict))
        return timed("commit", st, ctx, draft_logits, tree, logits, feats, cache, verdict,
                     experts)

    prefill = lambda: jax.block_until_ready(engine.prefill(prompts, key))
    if warmup:
        prefill()
    t0 = time.perf_counter()
    st = prefill()
    times["prefill"].append(time.perf_counter() - t0)
    m = engine.config.max_new_tokens
    if warmup and bool(np.any(~np.asarray(st.done_B))):
        one_round(st, record=False)
    start = time.perf_counter()
    while int(st.round) < m and bool(np.any(~np.asarray(st.done_B))):
        st = one_round(st, record=True)
    return st, times, time.perf_counter() - start + times["prefill"][0]


@dataclasses.dataclass(frozen=True)
class MethodResult:
    """One method of `compare_methods` over all prompts.

    Attributes:
      label: the method's name.
      tau: output tokens per round over all prompts.
      tokens_per_second: new tokens over the median of the passes' seconds.
      tokens: new tokens in all.
      outputs: the generated tokens of each prompt.
      seconds: each timed pass's seconds over all prompts (passes in order).
    """

    label: str
    tau: float
    tokens_per_second: float
    tokens: int
    outputs: list[list[int]]
    seconds: list[float] = dataclasses.field(default_factory=list)


def compare_methods(target, methods: Sequence[tuple[str, object, DecodeConfig]],
                    prompts: Sequence[Sequence[int]], *, key=0, repeats: int = 5,
                    on_method: Callable[[int, str], None] | None = None
                    ) -> list[MethodResult]:
    """Times decoding methods on the same prompts, one prompt at a time.

    Every (method, prompt) program is compiled first; then ``repeats`` timed passes run
    every method over all prompts, the methods in a rotated order each pass, so that a
    load that comes and goes on a shared machine hits them alike. The median pass counts;
    each pass's seconds are kept (`MethodResult.seconds`) for the spread of the ratios.
    Give the configs one ``prompt_len`` so that the prompts share one compilation per
    method.

    Args:
      target: the target model.
      methods: (label, drafter or None, config) per method.
      prompts: token-id lists.
      key: PRNG key or seed (the same for every method and prompt).
      repeats: timed passes.
      on_method: called with (index, label) before each method compiles (progress).
    """
    runs = []
    for i, (label, drafter, config) in enumerate(methods):
        if on_method is not None:
            on_method(i, label)
        runs.append([compiled_generate(target, drafter, [p], config, key) for p in prompts])
    passes = max(repeats, 1)
    seconds = [[0.0] * passes for _ in methods]
    gens: list[list[Generation]] = [[] for _ in methods]
    for r in range(passes):
        for k in range(len(methods)):
            signals.check()  # between passes
            m = (k + r) % len(methods)
            gens[m] = [run() for run in runs[m]]
            seconds[m][r] = sum(g.stats.seconds for g in gens[m])
    results = []
    for m, (label, _, _) in enumerate(methods):
        tokens = sum(int(g.lengths[0]) for g in gens[m])
        blocks = sum(int(g.stats.block_lengths.sum()) for g in gens[m])
        rounds = sum(int(g.stats.rounds_per_row.sum()) for g in gens[m])
        results.append(MethodResult(label, blocks / rounds if rounds else float("nan"),
                                    tokens / float(np.median(seconds[m])), tokens,
                                    [g.rows()[0] for g in gens[m]], seconds[m]))
    return results


__all__ = ["MethodResult", "compare_methods", "compiled_generate", "profile_generate",
           "streamed_generate", "timed_generate"]
