"""Round costs for the tree budget (docs/design.md §13): seconds of one decode round per
(batch size, budget) and of one AR step per batch size, and the budget that gives the
most tokens per second (`tev_jax.costs.tune` pairs them with τ(b) from the exit law).

Two ways to a cost: `round_costs` times the engine's one-round programs on the local
devices; `roofline_costs` reads a TPU slice's or a GPU's compiler (no chips needed),
calibrated on a GPU with a measured table (`cost_basis` says which).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tev_jax.runtime import signals
from tev_jax.decode import DecodeConfig, aligned_len
from tev_jax.engine import Engine, as_key
from tev_jax.prompts import check_prompts

Progress = Callable[[str, int, int], None]
"""``progress(what, done, total)``: the steps as they get done."""


def _copy(st):
    return jax.tree.map(jnp.copy, st)


@functools.partial(jax.jit, donate_argnames=("st",))
def _noop(params, st):
    """A program with a round's arguments that does nothing: the cost of a call."""
    return st


def round_costs(target, drafter, prompt_ids: Sequence[Sequence[int]], config: DecodeConfig,
                budgets: Sequence[int], batch_sizes: Sequence[int], *, repeats: int = 10,
                key: jax.Array | int = 0, seed: int = 0, mesh=None,
                progress: Progress | None = None
                ) -> tuple[dict[int, dict[int, float]], dict[int, float]]:
    """Seconds of one decode round per (batch size, budget), and of one AR step per
    batch size, on the local devices.

    Every program (`tev_jax.engine.Engine.round` of ``config`` at each budget, and of
    ``builder='none'``) is compiled and run once first; then ``repeats`` passes time one
    round of each from a copy of its prefilled state (the round donates its state), the
    programs in a fresh random order every pass so that load drift hits them alike. The
    median counts, less the median of a no-op program called with the same arguments:
    the dispatch of a call, which the fused loop of `tev_jax.engine.generate` does not
    pay every round (a fifth of a small AR step on a CPU). Each program has the cache
    length `tev_jax.engine.generate` gives it (P + M + N, unless
    ``config.max_cache_len`` fixes one for all).

    Args:
      target, drafter: the models.
      prompt_ids: prompts to prefill (cycled to fill a batch).
      config: the `DecodeConfig` (its prompt buffer, M, sampling, verifier).
      budgets, batch_sizes: the grid.
      repeats: timed passes.
      key: PRNG key or seed of the prefill; seed: of the timing order.
      mesh: optional mesh.
      progress: called as ``progress("programs", done, total)`` as the programs (every
        budget and AR, per batch size) compile, then ``progress("timed passes", ...)``.
    Returns:
      ``(cost, ar)``: ``cost[B][b]`` and ``ar[B]`` in seconds.
    """
    prompts = check_prompts(prompt_ids, target.config.vocab_size, config.prompt_len)
    width = config.prompt_len or aligned_len(max(len(p) for p in prompts))
    base = dataclasses.replace(config, prompt_len=width, tuning=None)
    states, engines = {}, {}
    if progress:  # announced before the prefills compile (a round and a no-op each)
        progress("programs", 0, 2 * len(set(batch_sizes)) * (len(set(budgets)) + 1))
    for bs in batch_sizes:
        rows = [prompts[i % len(prompts)] for i in range(bs)]
        for b in (0, *budgets):
            signals.check()
            cfg = (dataclasses.replace(base, builder="none", budget=64) if b == 0
                   else dataclasses.replace(base, builder="ddtree", budget=b))
            engine = Engine.create(target, None if b == 0 else drafter, cfg, bs, mesh=mesh)
            engines[bs, b] = engine
            states[bs, b] = engine.prefill(engine.prompts(rows), as_key(key))
    calls = {(k, "round"): engines[k].round for k in engines}
    calls |= {(k, "noop"): functools.partial(_noop, engines[k].params) for k in engines}
    for i, ((k, _), call) in enumerate(calls.items()):
        signals.check()
        jax.block_until_ready(call(_copy(states[k])))
        if progress:
            progress("programs", i + 1, len(calls))
    times: dict[Any, list[float]] = {k: [] for k in calls}
    rng = np.random.default_rng(seed)
    names = list(calls)
    for r in range(max(repeats, 1)):
        if progress:
            progress("timed passes", r, max(repeats, 1))
        for i in rng.permutation(len(names)):
            name = names[i]
            st = jax.block_until_ready(_copy(states[name[0]]))
            t0 = time.perf_counter()
            jax.block_until_ready(calls[name](st))
            times[name].append(time.perf_counter() - t0)
    if progress:
        progress("timed passes", max(repeats, 1), max(repeats, 1))
    med = {k: max(float(np.median(times[k, "round"]) - np.median(times[k, "noop"])), 1e-9)
           for k in engines}
    cost = {bs: {b: med[bs, b] for b in budgets} for bs in batch_sizes}
    return cost, {bs: med[bs, 0] for bs in batch_sizes}


def roofline_costs(target_cfg, config: DecodeConfig, budgets: Sequence[int],
                   batch_sizes: Sequence[int], *, topology: str | None = None,
                   gpu: str | None = None,
                   mesh_axes: tuple[int, int, int] | None = None, dtype=jnp.bfloat16,
                   drafter_layers: int = 1, block_size: int = 16
                   ) -> tuple[dict[int, dict[int, float]], dict[int, float]]:
    """Seconds of one round per (batch size, budget) and of one AR step per batch size on
    a TPU slice (``topology``) or NVIDIA GPUs (``gpu``, e.g. 'h200x1'), from their
    compiler (`tev_jax.costs.plan.plan_decode_programs` over `tev_jax.costs.chips.slice_devices`
    or `tev_jax.costs.chips.gpu_devices`; no weights, no chips needed): the roofline, or on a GPU
    with a measured table the calibrated estimate (`tev_jax.costs.gpu_time`; `cost_basis`
    says which).

    Args:
      target_cfg: the target's `ModelConfig`.
      config: the `DecodeConfig` (``prompt_len`` set; a ``max_cache_len`` shared by all
        programs, default: the widest tree's).
      budgets, batch_sizes: the grid.
      topology, gpu: the slice ('v5e:2x4', ...) or the GPUs ('h200x1', ...): one of them.
      mesh_axes: (data, fsdp, tensor); default all devices on tensor.
      dtype: parameter and cache dtype; drafter_layers, block_size: the drafter.
    Raises:
      ValueError: no libtpu, an unknown slice, a mesh that does not fit, a chip without
        published figures.
    """
    from tev_jax.costs import plan
    from tev_jax import sharding as shd
    from tev_jax.costs import chips

    if config.prompt_len is None:
        raise ValueError("roofline costs need DecodeConfig.prompt_len")
    if (topology is None) == (gpu is None):
        raise ValueError("roofline costs need one of a TPU slice (topology) or GPUs (gpu)")
    if gpu is not None:
        from tev_jax.costs.chips import gpu_devices

        tpu = gpu_devices(gpu)
    else:
        tpu = chips.slice_devices(topology)
    if tpu.chip is None:
        raise ValueError(f"no published figures for the chips of {topology or gpu!r}: "
                         "no roofline")
    data, fsdp, tensor = mesh_axes or (1, 1, len(tpu.devices))
    mesh = shd.make_mesh(data, fsdp, tensor, devices=tpu.devices)
    max_len = config.max_cache_len or aligned_len(config.prompt_len + config.max_new_tokens
                                             + max(budgets) + 1)
    base = dataclasses.replace(config, max_cache_len=max_len, tuning=None)
    kw = dict(dtype=dtype, drafter_layers=drafter_layers, block_size=block_size, mesh=mesh,
              chip=tpu.chip, devices_per_chip=tpu.devices_per_chip)
    cost: dict[int, dict[int, float]] = {}
    ar: dict[int, float] = {}
    for bs in batch_sizes:
        ar_cfg = dataclasses.replace(base, builder="none", budget=64)
        ar[bs] = plan.plan_decode_programs(target_cfg, ar_cfg, bs, programs=("ar_step",),
                                           **kw).seconds("ar_step")
        cost[bs] = {b: plan.plan_decode_programs(
            target_cfg, dataclasses.replace(base, builder="ddtree", budget=b), bs,
            programs=("round",), **kw).seconds("round") for b in budgets}
    return cost, ar


def cost_basis(gpu: str | None) -> str:
    """What `roofline_costs` gives: 'calibrated estimate' on a GPU with a measured table
    (`tev_jax.costs.gpu_time.load`), else 'roofline' (a floor)."""
    from tev_jax.costs import gpu_time
    from tev_jax.costs.chips import parse_gpu_name

    calibrated = gpu is not None and gpu_time.load(parse_gpu_name(gpu)[0].name) is not None
    return "calibrated estimate" if calibrated else "roofline"


def best_budgets(tau: dict[int, float], cost: dict[int, dict[int, float]],
                 ar: dict[int, float]) -> dict[int, dict[str, float]]:
    """The budget that maximises ``B * tau(b) / t(b, B)`` per batch size, AR included.

    Args:
      tau: budget -> predicted tokens per round.
      cost: ``cost[B][b]`` seconds per round; ar: ``ar[B]`` seconds per AR step.
    Returns:
      ``{B: {"budget": b or 0 for AR, "tau", "tokens_per_second", "speedup"}}``, the
      speed-up over AR at the same batch size (1.0 for AR).
    """
    best = {}
    for bs, row in cost.items():
        pick = {"budget": 0, "tau": 1.0, "tokens_per_second": bs / ar[bs], "speedup": 1.0}
        for b, t in sorted(row.items()):
            rate = bs * tau[b] / t
            if rate > pick["tokens_per_second"]:
                pick = {"budget": b, "tau": tau[b], "tokens_per_second": rate,
                        "speedup": tau[b] * ar[bs] / t}
        best[bs] = pick
    return best


__all__ = ["best_budgets", "cost_basis", "roofline_costs", "round_costs"]
