"""Memory plan of a drafter training step on abstract models (docs/design.md §12).

`plan_step` builds the target and a DFlash drafter without weights
(`tev_jax.costs.plan.abstract_target`, `tev_jax.costs.plan.abstract_drafter`), lowers one optimiser
update with `train.step.lower` on a mesh and compiles it: the compiler's
`tev_jax.costs.plan.ProgramReport` gives the per-device bytes of the step's arguments
(target, drafter, optimiser state, batch) and of its temporaries (activations,
scratch), its FLOPs and bytes accessed. With ``topology`` (a TPU slice name such as
'v5p:2x2x2', `tev_jax.costs.chips`) the mesh lies over that slice's chips and the real TPU
compiler plans it from this machine, with ``gpu`` ('h100x8', `tev_jax.costs.chips`) over NVIDIA
GPUs and the real GPU compiler; then the step's roofline time and an MFU estimate
(`step_model_flops` over chips x peak x roofline time) come with it. This is what
``python -m train plan`` prints.

Measure in float32 on CPU: XLA:CPU makes float32 copies of bfloat16 weights, so the
temporary bytes of a bfloat16 compile there overstate what an accelerator uses; the
argument bytes are exact in any dtype.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax

from tev_jax import sharding as shd
from tev_jax.costs.chips import Chip, local_chip, plan_mesh
from tev_jax.costs.plan import (PRESETS, GiB, NotEnoughMemory, ProgramReport,
                                abstract_drafter, abstract_target, available_bytes,
                                compile_report, model_config)
from tev_jax.draft_opd import OpdConfig
from tev_jax.exit_train import ExitTrainConfig
from tev_jax.models.drafter import default_target_layer_ids
from tev_jax.sampling import Sampling
from train.config import OBJECTIVES
from train.opd_step import OpdStepConfig, lower_opd
from train.optimizer import OptimConfig
from train.step import StepConfig, lower


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Per-device bytes of one compiled training step.

    Attributes:
      report: the compiled step's `tev_jax.costs.plan.ProgramReport`; the donated train state
        is both argument and output (``alias_bytes``).
      info: the configuration, for printing.
      chip, devices_per_chip: the TPU chip of the plan and its devices per chip (None:
        no roofline).
      devices: devices of the mesh.
      model_flops: `step_model_flops` of the whole (global) step.
    """

    report: ProgramReport
    info: dict
    chip: Chip | None = None
    devices_per_chip: int = 1
    devices: int = 1
    model_flops: float | None = None

    @property
    def roofline_seconds(self) -> float | None:
        """The step's roofline time on ``chip`` (None off a known TPU)."""
        return self.report.roofline_seconds(self.chip, self.devices_per_chip)

    @property
    def mfu(self) -> float | None:
        """Model FLOPs / (chips x peak x roofline time): the best MFU the step could reach."""
        t = self.roofline_seconds
        if t is None or self.model_flops is None:
            return None
        chips = self.devices / self.devices_per_chip
        return self.model_flops / (chips * self.chip.peak_flops * t)

    @property
    def peak(self) -> int:
        """Arguments + temporaries + outputs not aliased to a donated argument."""
        r = self.report
        return r.argument_bytes + r.temp_bytes + max(r.output_bytes - r.alias_bytes, 0)

    def to_dict(self) -> dict:
        r = self.report
        return {**self.info, "argument_bytes": r.argument_bytes,
                "output_bytes": r.output_bytes, "alias_bytes": r.alias_bytes,
                "temp_bytes": r.temp_bytes, "peak_bytes": self.peak,
                "compile_seconds": round(r.compile_seconds, 1), "flops": r.flops,
                "bytes_accessed": r.bytes_accessed, "model_flops": self.model_flops,
                "roofline_seconds": self.roofline_seconds, "mfu": self.mfu,
                "chip": None if self.chip is None else self.chip.name}

    def format(self) -> str:
        g = lambda x: f"{x / GiB:.2f} GiB"
        r = self.report
        head = ", ".join(f"{k} {v}" for k, v in self.info.items())
        text = (f"{head}\n  per device: arguments {g(r.argument_bytes)}, temporary "
                f"{g(r.temp_bytes)}, outputs {g(r.output_bytes)} ({g(r.alias_bytes)} "
                f"donated), peak {g(self.peak)}; compiled in {r.compile_seconds:.0f} s")
        if self.roofline_seconds is not None:
            fits = self.peak <= self.chip.hbm_bytes / self.devices_per_chip
            text += (f"\n  on {self.chip.name}: {r.flops / 1e12:.2f} TFLOP and "
                     f"{r.bytes_accessed / 1e9:.2f} GB per device, roofline "
                     f"{self.roofline_seconds * 1e3:.1f} ms per update, MFU at most "
                     f"{self.mfu:.1%}; {'fits' if fits else 'does NOT fit'} in "
                     f"{self.chip.hbm_bytes / self.devices_per_chip / GiB:.1f} GiB of HBM")
        return text


def target_config_from(name_or_path: str, num_layers: int | None = None):
    """`tev_jax.costs.plan.model_config` of ``--target``: a preset name (`tev_jax.costs.plan.PRESETS`)
    or an HF config.json (file or directory), optionally cut to ``num_layers`` layers."""
    if name_or_path not in PRESETS and not Path(name_or_path).exists():
        raise ValueError(f"{name_or_path!r} is neither a preset ({sorted(PRESETS)}) nor a "
                         "config.json")
    return model_config(name_or_path, num_layers=num_layers)


def _taps(num_layers: int, num_taps: int) -> tuple[int, ...]:
    """The DFlash spacing, or layers spread over [0, L) when the target is too shallow
    for it (per-layer planning on a cut preset)."""
    taps = default_target_layer_ids(num_layers, num_taps)
    if all(0 <= t < num_layers for t in taps):
        return taps
    return tuple(round(i * (num_layers - 1) / max(num_taps - 1, 1)) for i in range(num_taps))


def step_model_flops(target_config, drafter, *, batch: int, seq_len: int, anchors: int,
                     budget: int, trees: bool = True) -> float:
    """The useful FLOPs of one global ExitTrain update (matmuls; attention scores left out).

    The target's layers read the B x L sequence once (its context pass) and the B x A x N
    tree nodes once (the scoring pass, N = budget + 1), with the LM head over the nodes;
    the drafter's layers and fc run forward and backward (x 3) over the B x A blocks of
    H + 1 positions, with the frozen head forward and backward (to its input) over the
    B x A x H draft rows. Without ``trees`` (a token-only or Draft-OPD step) there is no
    scoring pass. ``2 * parameters`` FLOPs per token for a forward; a mixture
    of experts counts the k experts a token uses, not all E.
    """
    d, v = target_config.hidden_size, target_config.vocab_size
    head = d * v
    count = lambda tree: sum(math.prod(x.shape) for x in jax.tree.leaves(tree)
                             if isinstance(x, jax.ShapeDtypeStruct))
    unused = sum(3 * (s.moe.num_experts - s.moe.top_k) * d * s.moe.expert_size
                 for s in target_config.layer_specs if s.moe is not None)
    layer_params = count(abstract_target(target_config, "float32").layers) - unused
    draft_params = count(drafter)
    h = drafter.config.horizon
    blocks = batch * anchors
    nodes = blocks * (budget + 1) if trees else 0
    return float(2 * layer_params * (batch * seq_len + nodes) + 2 * head * nodes
                 + 6 * draft_params * blocks * (h + 1) + 4 * head * blocks * h)


def plan_step(target_config, *, drafter_layers: int = 1, num_taps: int = 5,
              block_size: int = 16, batch: int = 8, seq_len: int = 2048,
              anchors: int = 32, budget: int = 32, loss: str = "exit",
              objective: str = "exittrain",
              mesh_shape: tuple[int, int, int] = (1, 8, 1), target_dtype: str = "float32",
              param_dtype: str = "float32", compute_dtype: str | None = None,
              target_sharding: str = "fsdp", remat: str = "none",
              score_capacities: tuple[float, ...] = (),
              topology: str | None = None, gpu: str | None = None) -> StepPlan:
    """Compiles one training step on abstract models and reads its memory.

    Args:
      target_config: the target's `ModelConfig`.
      drafter_layers: DFlash drafter depth.
      num_taps: target layers the drafter reads (DFlash spacing,
        `tev_jax.models.drafter.default_target_layer_ids`, spread evenly when the
        target is too shallow for it).
      block_size, budget, loss: the drafter's block and the training recipe.
      objective: 'token', 'exittrain' or 'opd' (`train.config.TrainConfig`); an opd
        step has no trees (``budget`` and ``loss`` unused) and its batch carries the
        rounds' [B, A, H] targets (`train.opd_step`).
      batch, seq_len, anchors: the micro-batch (B, L, A).
      mesh_shape: (data, fsdp, tensor); needs that many devices (on CPU:
        ``XLA_FLAGS=--xla_force_host_platform_device_count=N``).
      target_dtype, param_dtype, compute_dtype, target_sharding, remat,
        score_capacities: as in `train.config.TrainConfig` (`train.step.StepConfig`,
        `tev_jax.exit_train.ExitTrainConfig`).
      topology: a TPU slice name ('v5p:2x2x2', `tev_jax.costs.chips.slice_devices`): the
        mesh lies over its chips (needs the tpu extra); None: the local devices.
      gpu: instead, NVIDIA GPUs by name ('h100x8', `tev_jax.costs.chips.gpu_devices`; needs
        the gpu extra).
    Returns:
      The `StepPlan`; its report's ``compile_seconds`` is the XLA compile time.
    """
    data, fsdp, tensor = mesh_shape
    if topology is not None or gpu is not None:
        mesh, tpu = plan_mesh(topology, gpu, data, fsdp, tensor)
    elif math.prod(mesh_shape) > jax.device_count():
        raise ValueError(f"mesh {mesh_shape} needs {math.prod(mesh_shape)} devices, "
                         f"{jax.device_count()} available (on CPU set XLA_FLAGS="
                         "--xla_force_host_platform_device_count=N or --host-devices)")
    else:
        tpu = None
        mesh = None if mesh_shape == (1, 1, 1) else shd.make_mesh(data, fsdp, tensor)
    taps = _taps(target_config.num_layers, num_taps)
    target = abstract_target(target_config, target_dtype)
    drafter = abstract_drafter(target_config, param_dtype, num_layers=drafter_layers,
                               block_size=block_size, target_layer_ids=taps)
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    optim = OptimConfig(lr=1e-4, steps=1000)
    if objective == "opd":
        scfg = OpdStepConfig(opd=OpdConfig(), taps=taps, horizon=drafter.config.horizon,
                             compute_dtype=compute_dtype, remat=remat,
                             target_sharding=target_sharding)
        lowered = lower_opd(target, drafter, scfg, optim, mesh, (batch, seq_len, anchors))
    else:
        loss = "token" if objective == "token" else loss
        exit_cfg = ExitTrainConfig(loss=loss, budget=budget, exit_lambda=0.1,
                                   sampling=Sampling(1.0), score_capacities=score_capacities)
        scfg = StepConfig(objective=exit_cfg, taps=taps, horizon=drafter.config.horizon,
                          compute_dtype=compute_dtype, remat=remat,
                          target_sharding=target_sharding)
        lowered = lower(target, drafter, scfg, optim, mesh, (batch, seq_len, anchors))
    report = compile_report(lowered)
    info = {"target_layers": target_config.num_layers, "hidden": target_config.hidden_size,
            "vocab": target_config.vocab_size, "drafter_layers": drafter_layers,
            "taps": len(taps), "mesh": "x".join(map(str, mesh_shape)),
            "batch": f"{batch}x{seq_len}", "anchors": anchors, "budget": budget,
            "objective": objective, "loss": loss if objective == "exittrain" else None,
            "target_dtype": target_dtype, "param_dtype": param_dtype,
            "compute_dtype": compute_dtype or param_dtype,
            "target_sharding": target_sharding, "remat": remat}
    if tpu is not None:
        info["topology" if gpu is None else "gpu"] = tpu.name
    return StepPlan(report, info, chip=local_chip() if tpu is None else tpu.chip,
                    devices_per_chip=1 if tpu is None else tpu.devices_per_chip,
                    devices=math.prod(mesh_shape),
                    model_flops=step_model_flops(target_config, drafter, batch=batch,
                                                 seq_len=seq_len, anchors=anchors,
                                                 budget=budget,
                                                 trees=objective == "exittrain"))


def plan_rollouts(target_config, *, drafter_layers: int = 1, block_size: int = 16,
                  budget: int = 32, builder: str = "ddtree", verifier: str = "tev",
                  temperature: float = 0.0, batch: int = 8, prompt_len: int = 256,
                  max_new_tokens: int = 256, mesh_shape: tuple[int, int, int] = (1, 1, 1),
                  target_dtype: str = "float32", topology: str | None = None,
                  gpu: str | None = None):
    """The rollout programs of a Draft-OPD run (`train.opd_rollouts`), compiled on
    abstract models: the prefill of one chunk and one traced round's decode round, per
    device (`tev_jax.costs.plan.plan_decode_programs`; a rollout phase is one prefill per
    batch and up to ``max_new_tokens`` rounds).

    Args:
      batch, prompt_len, max_new_tokens: the rollout batch (``opd_rollout_batch``),
        its prompt buffer and the response cap (``opd_max_new_tokens``).
      builder, budget, verifier, temperature: the rollouts' decode settings.
      mesh_shape, topology, gpu, target_dtype: as `plan_step`.
    Returns:
      The `tev_jax.costs.plan.DecodePlan` of 'prefill' and 'round'.
    """
    from tev_jax.costs.plan import plan_decode_programs
    from tev_jax.decode import DecodeConfig

    data, fsdp, tensor = mesh_shape
    if topology is not None or gpu is not None:
        mesh, tpu = plan_mesh(topology, gpu, data, fsdp, tensor)
    else:
        tpu = None
        mesh = None if mesh_shape == (1, 1, 1) else shd.make_mesh(data, fsdp, tensor)
    config = DecodeConfig(max_new_tokens=max_new_tokens, builder=builder, budget=budget,
                          verifier=verifier, sampling=Sampling(temperature),
                          prompt_len=prompt_len)
    return plan_decode_programs(target_config, config, batch, dtype=target_dtype,
                                drafter_layers=drafter_layers, block_size=block_size,
                                mesh=mesh, programs=("prefill", "round"),
                                chip=local_chip() if tpu is None else tpu.chip,
                                devices_per_chip=1 if tpu is None else tpu.devices_per_chip)



def _check_memory(need: int, parts: dict[str, int], cfg, mesh) -> None:
    mine = None if mesh is None else [d for d in mesh.devices.flat    # this process's
                                      if d.process_index == jax.process_index()]
    have, where = available_bytes(mine)
    if need > have:
        unit, size = ("GiB", GiB) if need >= GiB else ("MiB", 2**20)
        shown = ", ".join(f"{k} {v / size:.2f}" for k, v in parts.items())
        raise NotEnoughMemory(
            f"not enough memory: a training update needs {need / size:.2f} {unit} per "
            f"device ({shown} {unit}) but {have / size:.2f} {unit} of {where} is free; "
            f"lower num_anchors ({cfg.num_anchors}) or batch_size ({cfg.batch_size})")


def check_step_floor(cfg, *, seq_len: int, taps: int, width: int, itemsize: int,
                     mesh=None) -> None:
    """Refuses at once, from shapes, a step whose batch alone would not fit: the target's
    features at the drafter's ``taps`` for every position of the micro-batch
    (B x L x taps x D x itemsize, at best sharded over the whole mesh), which the step
    holds in any setting. `check_step_fits` then checks the compiled step.

    Raises:
      NotEnoughMemory: one line naming the flags to lower.
    """
    devices = 1 if mesh is None else mesh.devices.size
    features = -(-cfg.batch_size * seq_len * taps * width * itemsize // devices)
    _check_memory(features, {"target features": features}, cfg, mesh)


def check_step_fits(lowered, cfg, mesh=None) -> ProgramReport:
    """Compiles one update (``lowered``: the step the loop runs, so jax keeps the compile)
    and refuses it when its arguments, outputs and temporaries exceed the free memory of
    a device (`tev_jax.costs.plan.available_bytes`).

    Raises:
      NotEnoughMemory: one line with every part and the flags to lower.
    """
    r = compile_report(lowered)
    parts = {"arguments": r.argument_bytes, "temporaries": r.temp_bytes,
             "outputs": r.output_bytes - r.alias_bytes, "code": r.code_bytes}
    _check_memory(sum(parts.values()), parts, cfg, mesh)
    return r

__all__ = ["check_step_fits", "check_step_floor", "StepPlan", "plan_rollouts", "plan_step", "step_model_flops", "target_config_from"]
