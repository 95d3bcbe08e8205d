"""A GPU program's time, calibrated on a measured GPU: what ``plan --gpu`` estimates.

The roofline of a compiled program, ``max(FLOPs / peak, bytes / HBM bandwidth)``, is a
floor: on one H200 (2026-12-04) tev-jax's programs ran 1.6-4x above it, because no
kernel streams at the data sheet's bandwidth and because a program of ~2000 kernels pays
for every launch. A `Calibration` holds what one GPU was measured to reach per class of
op (`op_class`), as achieved bytes/s and FLOP/s, and the cost of one kernel launch;
`estimate` weighs a compiled program's ops (`tev_jax.costs.op_costs`) and launches
(`tev_jax.costs.launches`) with it:

    time = sum over ops of max(bytes / class bytes/s, FLOPs / class FLOP/s, launches x
           launch cost) + the launches no op accounts for (loop conditions) x launch cost

An op's kernels queue behind each other, so a kernel shorter than the launch interval
costs the interval and a longer one hides it. The figure is a calibrated estimate of the
GPU time of one call inside a fused loop; one dispatch from the host (`Engine.round`)
adds `Calibration.call_seconds`.

The tables are committed data, one JSON file per GPU in ``tev_jax/data/gpus/``
(`load`), written by ``experiments/gpu/measure.py`` on that GPU (`Calibration.write`).
A GPU without a table has only its roofline, and the plan says so.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

TABLES = Path(__file__).resolve().parents[1] / "data" / "gpus"
"""Where the committed calibration tables live (``<gpu>.json``)."""

CLASSES = ("stacked_matmul", "cache_attention", "gemm", "memory")
"""The op classes: our Pallas GEMM over a stack of weights, our Pallas attention over
the cache, XLA's matrix products (Triton GEMM fusions and cuBLAS calls), and every other
kernel (XLA's elementwise / reduction / gather / scatter fusions, copies, sorts,
collectives, other custom calls)."""


@dataclasses.dataclass(frozen=True)
class Rate:
    """What one class of op reached on a GPU.

    Attributes:
      bytes_per_second: HBM bytes moved per second (the op's bytes over its time).
      flops_per_second: FLOPs per second where the class was bound by arithmetic.
      measured: the measurements it comes from, in words.
    """

    bytes_per_second: float
    flops_per_second: float
    measured: str = ""


@dataclasses.dataclass(frozen=True)
class Calibration:
    """One GPU's measured rates.

    Attributes:
      gpu: the GPU's name in `tev_jax.costs.chips.GPUS` ('h200').
      rates: `CLASSES` -> `Rate`.
      launch_seconds: the GPU time of one kernel that moves almost nothing, back to back
        with others (a fused loop's round of tiny kernels over its launches).
      call_seconds: what one dispatch of a program from the host adds (a dispatched
        round over the same round inside the fused loop).
      source: where and when it was measured.
    """

    gpu: str
    rates: dict[str, Rate]
    launch_seconds: float
    call_seconds: float
    source: str

    def __post_init__(self):
        missing = [c for c in CLASSES if c not in self.rates]
        if missing:
            raise ValueError(f"the calibration of {self.gpu!r} has no rate for {missing}")
        bad = [c for c, r in self.rates.items()
               if not (r.bytes_per_second > 0 and r.flops_per_second > 0)]
        if bad or not (self.launch_seconds >= 0 and self.call_seconds >= 0):
            raise ValueError(f"the calibration of {self.gpu!r} has non-positive rates "
                             f"({bad}) or a negative launch / call cost")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        try:
            return cls(gpu=d["gpu"], rates={k: Rate(**v) for k, v in d["rates"].items()},
                       launch_seconds=float(d["launch_seconds"]),
                       call_seconds=float(d["call_seconds"]), source=d.get("source", ""))
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a GPU calibration table: {e}") from e

    def write(self, path) -> None:
        Path(path).write_text(json.dumps(self.as_dict(), indent=1) + "\n")


def load(gpu: str, tables: Path = TABLES) -> Calibration | None:
    """The committed calibration of ``gpu`` ('h200'), None where none was measured.

    Raises:
      ValueError: a table that exists but does not parse (named).
    """
    path = Path(tables) / f"{gpu}.json"
    if not path.is_file():
        return None
    try:
        return Calibration.from_dict(json.loads(path.read_text()))
    except (ValueError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: {e}") from e


def op_class(source: str, kind: str) -> str:
    """The class (`CLASSES`) of an op from its source line (`tev_jax.costs.op_costs.Op.source`)
    and its launch kind (`tev_jax.costs.launches.Launch.kind`)."""
    if kind == "pallas" and "stacked_matmul" in source:
        return "stacked_matmul"
    if kind == "pallas" and "cache_attention" in source:
        return "cache_attention"
    if kind in ("triton gemm", "cublas"):
        return "gemm"
    return "memory"


def estimate(ops, launch_items, calibration: Calibration) -> dict:
    """The calibrated time of one call of a compiled program (see the module docstring).

    Args:
      ops: its `tev_jax.costs.op_costs.op_costs`.
      launch_items: its `tev_jax.costs.launches.launches` (the same HLO).
      calibration: the GPU's `Calibration`.
    Returns:
      {'seconds': the estimate; 'classes': {class: seconds}, 'launch_bound': seconds
      of ops that took their launches' time rather than their bytes' or FLOPs'}.
    """
    kinds = {x.name: x for x in launch_items}
    classes = dict.fromkeys(CLASSES, 0.0)
    bound, seen = 0.0, set()
    for o in ops:
        launch = kinds.get(o.name)
        if launch is None:  # does not run (the smaller branch of a conditional)
            continue
        n = launch.count
        cls = op_class(o.source, launch.kind)
        rate = calibration.rates[cls]
        work = max(o.hbm_bytes / rate.bytes_per_second, o.flops / rate.flops_per_second)
        t = max(work, n * calibration.launch_seconds)
        bound += t - work
        classes[cls] += t
        seen.add(o.name)
    rest = sum(x.count for x in launch_items if x.name not in seen)
    classes["memory"] += rest * calibration.launch_seconds
    bound += rest * calibration.launch_seconds
    return {"seconds": sum(classes.values()), "classes": classes, "launch_bound": bound}


def fit(start: Calibration, programs, *, peak_flops: float, hbm_bandwidth: float,
        prior: float = 0.1, rounds: int = 60) -> tuple[Calibration, float]:
    """The calibration that best explains measured programs, from ``start``.

    Kernels timed alone (``start``'s rates) are not the same kernels inside a program:
    on the H200 the stacked GEMM streamed 2.1 TB/s alone, while the AR step it is most
    of read its 15.5 GB in 7.1 ms. So the rates and the launch cost are moved, by
    coordinate search in steps of 3-25 %, to minimise the sum of squared log ratios of
    estimate to measurement plus ``prior`` times the squared log ratios of each figure
    to its start (more figures than measurements: without it the search trades one
    class against another), each rate held under the GPU's published peak.

    Args:
      start: the first guess (e.g. the kernels-alone rates).
      programs: (ops, launch items, measured seconds, dispatched) per measured
        program; ``dispatched`` adds `Calibration.call_seconds` to its estimate.
      peak_flops, hbm_bandwidth: the GPU's published ceilings.
    Returns:
      (the calibration, the largest ratio max(estimate / measured, measured / estimate)).
    Raises:
      ValueError: no programs, or a measurement that is not positive.
    """
    import math

    programs = list(programs)
    if not programs or any(not p[2] > 0 for p in programs):
        raise ValueError("fitting needs measured programs with positive times")

    def errors(cal):
        return [math.log((estimate(ops, items, cal)["seconds"]
                          + cal.call_seconds * bool(dispatched)) / seconds)
                for ops, items, seconds, dispatched in programs]

    def figures(cal):
        return [getattr(cal.rates[c], f) for c in CLASSES
                for f in ("bytes_per_second", "flops_per_second")] + [cal.launch_seconds]

    first = figures(start)

    def loss(cal):
        drift = sum(math.log(a / b) ** 2 for a, b in zip(figures(cal), first) if b > 0)
        return sum(e * e for e in errors(cal)) + prior * drift

    def moved(cal, name, factor):
        if name == "launch_seconds":
            return dataclasses.replace(cal, launch_seconds=cal.launch_seconds * factor)
        cls, field = name.split(".")
        rate = getattr(cal.rates[cls], field) * factor
        if rate > (peak_flops if field == "flops_per_second" else hbm_bandwidth):
            return None
        rates = dict(cal.rates)
        rates[cls] = dataclasses.replace(rates[cls], **{field: rate})
        return dataclasses.replace(cal, rates=rates)

    names = [f"{c}.{f}" for c in CLASSES for f in ("bytes_per_second", "flops_per_second")]
    names.append("launch_seconds")
    best, best_loss = start, loss(start)
    for _ in range(rounds):
        improved = False
        for name in names:
            for factor in (1.25, 1.1, 1.03, 1 / 1.03, 1 / 1.1, 1 / 1.25):
                cal = moved(best, name, factor)
                if cal is not None and (l := loss(cal)) < best_loss - 1e-12:
                    best, best_loss, improved = cal, l, True
        if not improved:
            break
    return best, math.exp(max(abs(e) for e in errors(best)))


__all__ = ["CLASSES", "Calibration", "Rate", "TABLES", "estimate", "fit", "load", "op_class"]
