"""What a compiled program needs and does on one device: `ProgramReport`.

Memory from the compiler (``memory_analysis``), FLOPs and bytes from its cost analysis
or, where it gives none (GPU), from the optimised HLO (`tev_jax.costs.op_costs`), the roofline
time on a chip's published figures, and on GPUs the kernel launches of one call
(`tev_jax.costs.launches`) and, where the GPU was measured, a calibrated time estimate
(`tev_jax.costs.gpu_time`). `tev_jax.costs.plan` compiles the decode programs and reports them
with it; ``train.plan`` the training step.
"""

from __future__ import annotations

import dataclasses
import time

import jax

from tev_jax.costs import gpu_time, launches, op_costs
from tev_jax.decode import STAGES
from tev_jax.models.layers import LAYER_SCOPE
from tev_jax.costs.chips import Chip

GiB = 2**30

LAYER_SCOPES = (LAYER_SCOPE, "draft/while/body", "verify/while/body")
"""Where a decode program's layer stack runs: `scan_layers`' scope (a scan, or a loop of
per-layer programs on GPU), and the outermost loop of the draft and verify stages (a
model's own scan over its layers); `tev_jax.costs.launches.summary` counts the launches inside
them apart from the rest of the round."""


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    """What a compiled program needs and does on one device, from the compiler.

    Attributes:
      argument_bytes: inputs (parameters, prompts, key) resident during the call.
      output_bytes: results (the final decode state, caches included).
      temp_bytes: scratch the program allocates while it runs.
      alias_bytes: outputs that reuse donated argument buffers (counted in both above).
      code_bytes: generated code (0 on CPU).
      compile_seconds: the compile time (None if not measured).
      flops: floating-point operations of one call: ``cost_analysis``, which counts
        every loop body once, scaled by the trip counts of counted loops (the layer
        scan) and the bounds of bounded ones (the attention's key blocks, at a full
        cache) as the per-op table finds them (`tev_jax.costs.op_costs.loop_factors`); where
        the compiler gives no cost analysis (GPU) the per-op table's own sum. A loop of
        unknown trip count (the decode rounds) stays counted once.
      bytes_accessed: bytes read and written by one call, likewise (on GPU the per-op
        table's HBM bytes).
      launches: on a GPU, the kernel launches of one call (`tev_jax.costs.launches.summary`:
        total, inside the layer stack and outside it by stage, by kind); None elsewhere.
      estimate: on a GPU with a measured table (`tev_jax.costs.gpu_time.load`), the
        calibrated time of one call (`tev_jax.costs.gpu_time.estimate`, with the table's
        ``gpu``, ``source`` and ``call_seconds``); None elsewhere.
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    code_bytes: int
    compile_seconds: float | None = None
    flops: float | None = None
    bytes_accessed: float | None = None
    launches: dict | None = None
    estimate: dict | None = None

    @classmethod
    def of(cls, compiled: jax.stages.Compiled, compile_seconds: float | None = None, *,
           gpu: str | None = None) -> "ProgramReport":
        """The report of ``compiled.memory_analysis()`` and ``cost_analysis()`` (its
        loop bodies scaled by their trip counts, see the attributes); with ``gpu`` (a
        name of `tev_jax.costs.chips.GPUS`, the GPU it was compiled for) its launches and, where
        that GPU has a calibration table, the calibrated estimate."""
        m = compiled.memory_analysis()
        if m is None:
            raise ValueError("this backend gives no memory analysis for compiled programs")
        cost = compiled.cost_analysis() or {}
        if isinstance(cost, (list, tuple)):  # older jax: one dict per device program
            cost = cost[0] if cost else {}
        text = compiled.as_text()
        ops = op_costs.op_costs(text)
        flops_factor, bytes_factor = op_costs.loop_factors(ops)
        if not cost:  # the GPU compiler gives none: the per-op table's sums
            sums = op_costs.totals(ops)
            cost, flops_factor, bytes_factor = (
                {"flops": sums["flops"], "bytes accessed": sums["hbm_bytes"]}, 1.0, 1.0)
        get = lambda k, factor: float(cost[k]) * factor if k in cost else None
        counted, estimate = None, None
        if gpu is not None:
            items = launches.launches(text)
            counted = launches.summary(items, STAGES, LAYER_SCOPES)
            calibration = gpu_time.load(gpu)
            if calibration is not None:
                estimate = gpu_time.estimate(ops, items, calibration) | {
                    "gpu": gpu, "source": calibration.source,
                    "call_seconds": calibration.call_seconds}
        return cls(argument_bytes=int(m.argument_size_in_bytes),
                   output_bytes=int(m.output_size_in_bytes),
                   temp_bytes=int(m.temp_size_in_bytes),
                   alias_bytes=int(m.alias_size_in_bytes),
                   code_bytes=int(m.generated_code_size_in_bytes),
                   compile_seconds=compile_seconds,
                   flops=get("flops", flops_factor),
                   bytes_accessed=get("bytes accessed", bytes_factor),
                   launches=counted, estimate=estimate)

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs + scratch, donated buffers counted once."""
        return (self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes
                + self.code_bytes)

    def roofline_seconds(self, chip: Chip | None, devices_per_chip: int = 1) -> float | None:
        """``max(flops / peak, bytes accessed / bandwidth)`` on one device of ``chip``
        (a chip's figures shared by its ``devices_per_chip`` devices); None without a
        chip or a cost analysis."""
        if chip is None or self.flops is None or self.bytes_accessed is None:
            return None
        return max(self.flops / (chip.peak_flops / devices_per_chip),
                   self.bytes_accessed / (chip.hbm_bandwidth / devices_per_chip))

    @property
    def estimate_seconds(self) -> float | None:
        """The calibrated GPU time of one call in a fused loop (None without a table)."""
        return None if self.estimate is None else self.estimate["seconds"]

    def seconds(self, chip: Chip | None, devices_per_chip: int = 1) -> tuple[float | None, str]:
        """(the best time figure there is, what it is): the calibrated estimate where the
        GPU was measured ('calibrated'), else the roofline ('floor'), else (None, '')."""
        if self.estimate_seconds is not None:
            return self.estimate_seconds, "calibrated"
        t = self.roofline_seconds(chip, devices_per_chip)
        return t, "" if t is None else "floor"

    def as_dict(self, chip: Chip | None = None, devices_per_chip: int = 1) -> dict:
        t, basis = self.seconds(chip, devices_per_chip)
        return dataclasses.asdict(self) | {
            "peak_bytes": self.peak_bytes,
            "roofline_seconds": self.roofline_seconds(chip, devices_per_chip),
            "seconds": t, "seconds_are": basis}

    def format(self) -> str:
        """A few aligned lines in GiB."""
        rows = [("arguments", self.argument_bytes), ("outputs", self.output_bytes),
                ("temporary", self.temp_bytes), ("aliased", self.alias_bytes),
                ("code", self.code_bytes), ("peak", self.peak_bytes)]
        lines = [f"  {name:<10}{b / GiB:10.3f} GiB" for name, b in rows]
        if self.compile_seconds is not None:
            lines.append(f"  (compiled in {self.compile_seconds:.1f} s)")
        return "\n".join(lines)


def compile_report(lowered: jax.stages.Lowered, *, gpu: str | None = None) -> ProgramReport:
    """Compiles ``lowered``; -> its `ProgramReport`, with the compile time (and, for the
    GPU ``gpu``, its launches and calibrated estimate)."""
    t0 = time.perf_counter()
    compiled = lowered.compile()
    return ProgramReport.of(compiled, time.perf_counter() - t0, gpu=gpu)


__all__ = ["LAYER_SCOPES", "ProgramReport", "compile_report"]
