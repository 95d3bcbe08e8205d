"""Memory planning on abstract models (docs/design.md §12).

Real model shapes live here as `ModelConfig` presets, so that a decode or training
program can be lowered and compiled for a Qwen3-4B or Llama-3-8B target on a machine
that could never hold its weights (``nnx.eval_shape`` builds the model without them).
`plan_decode` compiles the fused generation of a `tev_jax.engine.Engine` for such a model and
returns the compiler's per-device `ProgramReport`; `check_decode_fits` is the cheap
analytic pre-flight that `tev-jax generate` runs before compiling anything.

The presets copy the architecture fields of the public ``config.json`` files (widths,
heads, vocabulary, RoPE); nothing else about those models is used.

Figures are per device (one shard of a sharded program). On CPU, XLA converts bfloat16
weights to float32 copies, so bfloat16 temporary memory measured there overstates what
an accelerator needs; float32 on CPU is the honest figure.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from tev_jax.costs import launches, op_costs
from tev_jax.decode import STAGES, DecodeConfig
from tev_jax.drafters import as_drafter
from tev_jax.engine import Engine, decode_spec
from tev_jax.costs.chips import GPUS
from tev_jax.costs.program_report import GiB, ProgramReport, compile_report
from tev_jax.costs.chips import chip_of
from tev_jax.costs.chips import Chip
from tev_jax.models.checkpoint_io import read_config
from tev_jax.models.config import AttentionSpec, ModelConfig, RopeScaling
from tev_jax.models.drafter import Drafter, DrafterConfig, default_target_layer_ids
from tev_jax.models.target import Target
from tev_jax.sampling import PER_ROW

PRESETS: dict[str, ModelConfig] = {
    "qwen3-0.6b": ModelConfig(
        model_type="qwen3", vocab_size=151_936, hidden_size=1024, intermediate_size=3072,
        num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, qk_norm=True,
        max_position_embeddings=40_960),
    "qwen3-4b": ModelConfig(
        model_type="qwen3", vocab_size=151_936, hidden_size=2560, intermediate_size=9728,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, qk_norm=True,
        max_position_embeddings=40_960),
    "qwen3-8b": ModelConfig(
        model_type="qwen3", vocab_size=151_936, hidden_size=4096, intermediate_size=12_288,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, qk_norm=True,
        max_position_embeddings=40_960),
    "llama3-8b": ModelConfig(
        model_type="llama", vocab_size=128_256, hidden_size=4096, intermediate_size=14_336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500_000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), rms_norm_eps=1e-5,
        tie_word_embeddings=False, qk_norm=False, max_position_embeddings=131_072),
    # a mixture of 128 experts, top 8, in every layer (3.3 B of 30.5 B parameters active)
    "qwen3-coder-30b-a3b": ModelConfig(
        model_type="qwen3_moe", vocab_size=151_936, hidden_size=2048, intermediate_size=6144,
        num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
        rope_theta=10_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, qk_norm=True,
        max_position_embeddings=262_144, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True),
}

# Gemma 4-12B-IT: 5 sliding (window 1024, 8 kv heads of 256) + 1 global layer (one k = v
# head of 512, proportional RoPE), tied head with soft-cap 30 (google/gemma-4-12B-it).
PRESETS["gemma-4-12b"] = ModelConfig(
    model_type="gemma4_unified_text", vocab_size=262_144, hidden_size=3840,
    intermediate_size=15_360, num_layers=48, num_heads=16, num_kv_heads=8, head_dim=256,
    rope_theta=10_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, qk_norm=True,
    max_position_embeddings=131_072, bos_token_id=2, eos_token_ids=(1,),
    layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                      for i in range(48)),
    sliding_window=1024, global_attention=AttentionSpec(512, 1, None, True, 1e6, 0.25),
    norm_style="float32", sandwich_norms=True, v_norm=True, attention_scale=1.0,
    hidden_act="gelu_tanh", embed_scale=3840 ** 0.5, final_logit_softcap=30.0)

# A DFlash drafter's layers are Qwen3's whatever the target family (docs/design.md §6).
QWEN3_LAYERS = dict(layer_types=(), sliding_window=None, global_attention=None,
                    attention_window="native", norm_style="cast", sandwich_norms=False,
                    v_norm=False, attention_scale=None, hidden_act="silu", embed_scale=None,
                    final_logit_softcap=None)


def preset(name: str, *, num_layers: int | None = None) -> ModelConfig:
    """A preset's `ModelConfig`, optionally with fewer layers (for per-layer planning).

    Raises:
      ValueError: an unknown name (the message lists the presets).
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return with_layers(PRESETS[name], num_layers)


def with_layers(cfg: ModelConfig, num_layers: int | None) -> ModelConfig:
    """``cfg`` with ``num_layers`` decoder layers (unchanged for None); per-layer
    attention types keep their pattern (Gemma 4: 5 sliding, 1 global)."""
    if num_layers is None:
        return cfg
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    types = cfg.layer_types
    if types:  # the first num_layers of the repeating pattern
        types = tuple(types[i % len(types)] for i in range(num_layers))
    return dataclasses.replace(cfg, num_layers=num_layers, layer_types=types)


def model_config(name_or_path: str, *, num_layers: int | None = None) -> ModelConfig:
    """A preset name, a Hugging Face ``config.json`` file or a directory holding one.

    Raises:
      ValueError: neither a preset nor a readable config (the message says which).
    """
    if name_or_path in PRESETS:
        return preset(name_or_path, num_layers=num_layers)
    path = Path(name_or_path)
    if path.name == "config.json" and path.is_file():
        path = path.parent
    if not path.is_dir():
        raise ValueError(f"{name_or_path!r} is neither a model preset {sorted(PRESETS)} "
                         "nor a config.json file (or a directory with one)")
    return with_layers(read_config(path), num_layers)


# ------------------------------------------------------------------ abstract models


def abstract_target(cfg: ModelConfig, dtype=jnp.float32):
    """A `Target` whose parameters are ``jax.ShapeDtypeStruct`` s (no weights made)."""
    return nnx.eval_shape(lambda: Target(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0)))


def drafter_config(target_cfg: ModelConfig, *, num_layers: int = 1, block_size: int = 16,
                   target_layer_ids: tuple[int, ...] | None = None):
    """A DFlash `DrafterConfig` for ``target_cfg``: Qwen3 layers of the target's widths.

    The taps are ``target_layer_ids``, by default `default_target_layer_ids`; the mask
    token is the last vocabulary id (any id gives the same shapes).
    """
    model = dataclasses.replace(target_cfg, model_type="qwen3", qk_norm=True,
                                num_layers=num_layers, rope_scaling=None, num_experts=0,
                                mlp_only_layers=(), **QWEN3_LAYERS)
    taps = (default_target_layer_ids(target_cfg.num_layers, num_layers)
            if target_layer_ids is None else tuple(target_layer_ids))
    return DrafterConfig(
        model=model, block_size=block_size, num_target_layers=target_cfg.num_layers,
        mask_token_id=target_cfg.vocab_size - 1, target_layer_ids=taps)


def abstract_drafter(target_cfg: ModelConfig, dtype=jnp.float32, *, num_layers: int = 1,
                     block_size: int = 16, target_layer_ids: tuple[int, ...] | None = None):
    """A DFlash `Drafter` (see `drafter_config`) without weights."""
    cfg = drafter_config(target_cfg, num_layers=num_layers, block_size=block_size,
                         target_layer_ids=target_layer_ids)
    return nnx.eval_shape(lambda: Drafter(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0)))


# -------------------------------------------------------------------- decode plans


def abstract_models(target_cfg: ModelConfig, config, *, dtype=jnp.float32,
                    drafter_layers: int = 1, block_size: int = 16):
    """(target, drafter or None) without weights for a decode ``config``."""
    target = abstract_target(target_cfg, dtype)
    drafter = (None if config.builder == "none" else
               abstract_drafter(target_cfg, dtype, num_layers=drafter_layers,
                                block_size=block_size))
    return target, drafter


def plan_decode(target_cfg: ModelConfig, config, batch_size: int, *, dtype=jnp.float32,
                drafter_layers: int = 1, block_size: int = 16, mesh=None) -> ProgramReport:
    """Compiles the fused generation for abstract models; -> the per-device report.

    Args:
      target_cfg: the target's `ModelConfig` (e.g. `preset`).
      config: a `tev_jax.decode.DecodeConfig` with ``prompt_len`` set.
      batch_size: B.
      dtype: parameter and cache dtype of both models.
      drafter_layers, block_size: the DFlash drafter (see `drafter_config`); no drafter
        with ``builder='none'``.
      mesh: a mesh from `tev_jax.sharding.make_mesh` (over a TPU slice's devices for a
        TPU plan, `tev_jax.costs.chips.slice_devices`), or None for one device.
    """
    target, drafter = abstract_models(target_cfg, config, dtype=dtype,
                                      drafter_layers=drafter_layers, block_size=block_size)
    return compile_report(Engine.create(target, drafter, config, batch_size, mesh=mesh).lower())


DECODE_PROGRAMS = ("generation", "ar_step", "round", "prefill", *STAGES)
"""The programs of a decode plan: the whole fused generation (what must fit), one AR
step (the baseline), one speculative round, the prefill of one chunk, and each stage of
a round."""


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """The compiled decode programs of one configuration, per device.

    Attributes:
      programs: name (`DECODE_PROGRAMS`) -> `ProgramReport`; the ones planned.
      batch_size: B.
      chip: the chip the rooflines use (None: no roofline).
      devices_per_chip: devices sharing one chip's figures.
      ops: 'ar_step' / 'round' -> the `tev_jax.costs.op_costs.Op` s of that loop
        (`loop_ops`); empty unless asked for.
      top: how many ops the tables show.
      floors: 'ar_step' / 'round' -> `round_floor` of the planned ones.
    """

    programs: dict[str, ProgramReport]
    batch_size: int
    chip: Chip | None = None
    devices_per_chip: int = 1
    ops: dict[str, tuple[op_costs.Op, ...]] = dataclasses.field(default_factory=dict)
    top: int = 10
    floors: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    def seconds(self, name: str) -> float | None:
        """The time of one program: the calibrated estimate where the GPU was measured,
        else the roofline (`seconds_are` says which; None without a chip)."""
        report = self.programs.get(name)
        return None if report is None else report.seconds(self.chip,
                                                           self.devices_per_chip)[0]

    @property
    def seconds_are(self) -> str:
        """What `seconds` are: 'calibrated' (an estimate from a GPU's measured table,
        `tev_jax.costs.gpu_time`), 'floor' (the roofline: no program runs faster) or ''."""
        kinds = {r.seconds(self.chip, self.devices_per_chip)[1] for r in self.programs.values()}
        return "calibrated" if kinds == {"calibrated"} else "floor" if "floor" in kinds else ""

    @property
    def break_even_tau(self) -> float | None:
        """Round time / AR step time: the τ at which speculation matches AR."""
        r, a = self.seconds("round"), self.seconds("ar_step")
        return None if r is None or a is None or a <= 0 else r / a

    def estimate(self, tau: float) -> dict[str, float] | None:
        """Tokens/s of the batch and speed-up over AR for an expected ``tau``."""
        r, a = self.seconds("round"), self.seconds("ar_step")
        if r is None or a is None:
            return None
        return {"tau": tau, "tokens_per_second": self.batch_size * tau / r,
                "ar_tokens_per_second": self.batch_size / a, "speedup": tau * a / r}

    def as_dict(self, tau: float | None = None) -> dict:
        """The JSON form: ``{"programs": {"generation": P, "ar_step": P, "round": P,
        "prefill": P, "stages": {stage: P}}, ...}``."""
        one = lambda name: self.programs[name].as_dict(self.chip, self.devices_per_chip)
        programs = {k: one(k) for k in self.programs if k not in STAGES}
        stages = {k: one(k) for k in STAGES if k in self.programs}
        if stages:
            programs["stages"] = stages
        out = {"programs": programs, "batch_size": self.batch_size,
               "chip": None if self.chip is None else dataclasses.asdict(self.chip),
               "devices_per_chip": self.devices_per_chip,
               "break_even_tau": self.break_even_tau, "seconds_are": self.seconds_are}
        if tau is not None:
            out["estimate"] = self.estimate(tau)
        for name, ops in self.ops.items():
            out["programs"].setdefault(name, {})["ops"] = op_costs.table_dict(
                ops, self.top, STAGES)
        for name, floor in self.floors.items():
            out["programs"].setdefault(name, {})["floor_bytes"] = floor
        return out

    def format(self, tau: float | None = None) -> str:
        """A table for people: memory, FLOPs, bytes and roofline time per program."""
        ms = lambda t: "-" if t is None else f"{t * 1e3:.3f} ms"
        calibrated = any(r.estimate is not None for r in self.programs.values())
        counted = any(r.launches is not None for r in self.programs.values())
        head = (f"{'program':<11}{'args':>9}{'temp':>9}{'out':>9}{'peak':>9} GiB"
                f"{'GFLOP':>10}{'GB acc.':>9}{'roofline':>11}"
                + (f"{'estimate':>11}" if calibrated else "")
                + (f"{'launches':>9}" if counted else "") + f"{'compile':>9}")
        lines = [head]
        for name, r in self.programs.items():
            gf = "-" if r.flops is None else f"{r.flops / 1e9:.2f}"
            gb = "-" if r.bytes_accessed is None else f"{r.bytes_accessed / 1e9:.3f}"
            n = "-" if r.launches is None else str(r.launches["total"])
            lines.append(
                f"{name:<11}{r.argument_bytes / GiB:9.3f}{r.temp_bytes / GiB:9.3f}"
                f"{r.output_bytes / GiB:9.3f}{r.peak_bytes / GiB:9.3f}    "
                f"{gf:>10}{gb:>9}{ms(r.roofline_seconds(self.chip, self.devices_per_chip)):>11}"
                + (f"{ms(r.estimate_seconds):>11}" if calibrated else "")
                + (f"{n:>9}" if counted else "") + f"{r.compile_seconds or 0:8.1f}s")
        if self.chip is not None:
            lines.append("roofline: max(FLOPs / peak, bytes / HBM bandwidth), a floor that no "
                         "program reaches" + ("" if calibrated or self.chip.name not in GPUS
                                              else f" (no measured table for {self.chip.name}"
                                              ": no calibrated estimate)"))
        if calibrated:
            e = next(r.estimate for r in self.programs.values() if r.estimate is not None)
            lines.append(f"estimate: calibrated on {e['gpu']} (tev_jax/data/gpus/{e['gpu']}.json: "
                         f"{e['source']}), one call in a "
                         f"fused loop; a dispatch from the host adds "
                         f"{e['call_seconds'] * 1e3:.2f} ms (tev_jax.costs.gpu_time)")
        for name, r in self.programs.items():
            if r.launches is not None and name in ("ar_step", "round"):
                lines.append(f"{name} launches: {launches.format_summary(r.launches)}")
        for name, f in self.floors.items():
            experts = ("" if not f["experts_touched"] else
                       f", experts {f['experts'] / 1e9:.3f} ({f['experts_touched']} of "
                       f"{f['experts_held']} per layer, uniform routing)")
            lines.append(f"floor of bytes per {name}: {sum_floor(f) / 1e9:.3f} GB (weights "
                         f"{f['weights'] / 1e9:.3f}{experts}, KV {f['kv'] / 1e9:.3f})")
        if self.break_even_tau is not None:
            lines.append(f"break-even tau (round / AR step) = {self.break_even_tau:.2f} "
                         f"({self.seconds_are})")
        if tau is not None and self.estimate(tau) is not None:
            e = self.estimate(tau)
            lines.append(f"at tau = {tau:g}: {e['tokens_per_second']:.0f} tokens/s for the "
                         f"batch (AR {e['ar_tokens_per_second']:.0f}), speed-up "
                         f"{e['speedup']:.2f}x ({self.seconds_are or 'roofline'})")
        for name, ops in self.ops.items():
            lines += ["", f"{name}: ops of the fused loop (per round, and once per call)",
                      op_costs.format_table(ops, self.top, STAGES)]
        return "\n".join(lines)


def plan_decode_programs(target_cfg: ModelConfig, config, batch_size: int, *,
                         dtype=jnp.float32, drafter_layers: int = 1, block_size: int = 16,
                         mesh=None, programs=DECODE_PROGRAMS, chip: Chip | None = None,
                         devices_per_chip: int = 1, ops: int = 0,
                         progress: Callable[[str, int, int], None] | None = None
                         ) -> DecodePlan:
    """Compiles each decode program for abstract models; -> the `DecodePlan`.

    The AR step is a round of the same engine with ``builder='none'``; the prefill is
    one chunk (``config.prefill_chunk`` tokens, or the whole buffer if it is smaller);
    all share the speculative engine's cache length.

    Args:
      target_cfg, config, batch_size, dtype, drafter_layers, block_size, mesh: as in
        `plan_decode`.
      programs: which of `DECODE_PROGRAMS` to compile.
      chip, devices_per_chip: for the rooflines (`tev_jax.costs.chips`); a GPU's chip
        (`tev_jax.costs.chips.GPUS`) also has each program's kernel launches counted and, where
        that GPU has a measured table (`tev_jax.costs.gpu_time`), its calibrated estimate.
      ops: with N > 0, also the per-op tables (`loop_ops`) of the AR step and the round,
        N ops each, the round's split by stage.
      progress: called as ``progress(program, done, total)`` after each program compiled
        (a compile of a large model takes minutes).
    Raises:
      ValueError: an unknown program name, or anything `Engine.create` refuses.
    """
    if not isinstance(ops, int) or ops < 0:
        raise ValueError(f"ops must be a non-negative int (ops listed per table), got {ops!r}")
    bad = [p for p in programs if p not in DECODE_PROGRAMS]
    if bad:
        raise ValueError(f"unknown programs {bad}; choose from {DECODE_PROGRAMS}")
    target, drafter = abstract_models(target_cfg, config, dtype=dtype,
                                      drafter_layers=drafter_layers, block_size=block_size)
    engine = Engine.create(target, drafter, config, batch_size, mesh=mesh)
    fixed = dataclasses.replace(config, max_cache_len=engine.spec.max_len)
    ar = Engine.create(target, None, dataclasses.replace(fixed, builder="none"), batch_size,
                       mesh=mesh)
    chunk = min(config.prompt_len, config.prefill_chunk or config.prompt_len)
    prefill = Engine.create(target, drafter, dataclasses.replace(fixed, prompt_len=chunk),
                            batch_size, mesh=mesh)
    lowered = {"generation": lambda: engine.lower("generate"),
               "ar_step": lambda: ar.lower("round"),
               "round": lambda: engine.lower("round"),
               "prefill": lambda: prefill.lower("prefill")}
    gpu = next((g for g, spec in GPUS.items() if chip is not None and spec.chip == chip), None)
    reports = {}
    todo = [p for p in programs if not (p == "draft" and engine.drafter is None)]  # AR: none
    for done, name in enumerate(todo, 1):
        lower = lowered.get(name) or (lambda name=name: engine.lower(name))
        reports[name] = compile_report(lower(), gpu=gpu)
        if progress:
            progress(name, done, len(todo))
    tables = {} if ops <= 0 else {"ar_step": loop_ops(ar), "round": loop_ops(engine)}
    floors = {name: round_floor(e) for name, e in (("ar_step", ar), ("round", engine))
              if name in programs}
    return DecodePlan(programs=reports, batch_size=batch_size, chip=chip,
                      devices_per_chip=devices_per_chip, ops=tables, top=max(ops, 1),
                      floors=floors)


def plan_serving(target_cfg: ModelConfig, configs: dict[int, DecodeConfig], **kw
                 ) -> dict[int, DecodePlan]:
    """The serving plan of a server's slot counts: ``configs`` maps each slot count to
    its config (as `tev_jax.slots.serving_configs` gives them for ``tev-jax serve
    --max-batch B``: each row's own sampling, the budget of that count); for each, the
    compiled round and AR step of that many rows; -> slot count -> `DecodePlan`
    (per-device peak memory, FLOPs, bytes and, with a chip, the roofline time of a
    round). ``kw``: as for `plan_decode_programs` (``mesh``, ``chip``, ``dtype``, ...);
    ``programs`` defaults to the round and the AR step."""
    kw.setdefault("programs", ("round", "ar_step"))
    return {slots: plan_decode_programs(target_cfg, c, slots, **kw)
            for slots, c in configs.items()}


def _device_bytes(x, sharding=None) -> int:
    sharding = getattr(x, "sharding", None) if sharding is None else sharding
    shape = x.shape if sharding is None else sharding.shard_shape(x.shape)
    return math.prod(shape) * jnp.dtype(x.dtype).itemsize


def round_floor(engine: Engine) -> dict[str, int]:
    """What one round of ``engine`` must read per device (bytes): the floor its HBM
    bytes are held against.

    - weights: every parameter the round reads but the experts (an untied embedding
      table only has its rows gathered: left out), each device's shard;
    - experts: a mixture's experts the round's B x N tokens touch in every sparse layer
      at uniform routing (`tev_jax.models.moe.expected_touched`; a real round's count is
      `tev_jax.generation.DecodeStats.experts_touched`), each device's share;
    - kv: both key/value caches, whole (the attention reads every key block), but a
      sliding layer of window W only its last ``min(L, W + N)`` of L slots.

    Returns:
      {'weights', 'experts', 'kv': bytes; 'experts_touched', 'experts_held': experts per
      sparse layer on one device, touched and held (0 without a mixture)}.
    """
    from tev_jax import sharding as shd
    from tev_jax.decode import merge_models
    from tev_jax.models.kv_cache import CACHE_AXES
    from tev_jax.models.moe import expected_touched

    target_cfg = merge_models(engine.graphdef, engine.params)[0].config
    tied = target_cfg.tie_word_embeddings
    weights = experts = held = 0
    for path, x in jax.tree_util.tree_leaves_with_path(engine.params):
        name = jax.tree_util.keystr(path)
        if name.startswith("[0]['embed_tokens']") and not tied:
            continue
        if name.startswith("[0]") and "['experts']" in name:
            experts += _device_bytes(x)
            held = (x.shape[1] if x.sharding is None
                    else x.sharding.shard_shape(x.shape)[1])
        else:
            weights += _device_bytes(x)
    touched = 0
    moe = next((s.moe for s in target_cfg.layer_specs if s.moe is not None), None)
    if moe is not None:
        tokens = engine.spec.batch_size * engine.spec.num_slots
        touched = expected_touched(held, moe.num_experts, moe.top_k, tokens)
        experts = experts * touched // held
    st = engine.abstract_state()
    seen = _visible_fractions(target_cfg, engine.spec.max_len, engine.spec.num_slots)
    caches = [(c, f) for kv in (st.cache.k, st.cache.v)
              for c, f in zip(jax.tree.leaves(kv), seen)]
    caches += [(c, 1.0) for c in ([st.ctx.k, st.ctx.v] if hasattr(st.ctx, "k") else [])]
    kv = sum(round(f * _device_bytes(c, None if engine.mesh is None else
                                     shd.logical_sharding(CACHE_AXES, c.shape, engine.mesh)))
             for c, f in caches)
    return {"weights": weights, "experts": experts, "kv": kv,
            "experts_touched": touched, "experts_held": held}


def _visible_fractions(config, max_len: int, num_slots: int) -> list[float]:
    """Per target cache array (`tev_jax.models.kv_cache.cache_shapes`), the fraction of
    its L slots a pass of N new tokens reads: 1 for a global layer, ``(W + N) / L`` (at
    most 1) for a sliding one, averaged over the array's layers."""
    def frac(spec):
        w = spec.attention.window
        return 1.0 if w is None else min(1.0, (w + num_slots) / max_len)

    specs = config.layer_specs
    if config.uniform_attention_shapes:
        return [sum(map(frac, specs)) / len(specs)]
    return [frac(s) for s in specs[:config.period]]


def sum_floor(floor: dict[str, int]) -> int:
    """The bytes of a `round_floor`."""
    return floor["weights"] + floor["experts"] + floor["kv"]


def loop_ops(engine: Engine) -> tuple[op_costs.Op, ...]:
    """The ops of ``engine``'s rounds the way the fused loop runs them: its
    ``run_rounds`` program compiled, each op marked per round (inside the loop) or once
    per call (outside: e.g. layouts the compiler hoisted out of the loop)."""
    return tuple(op_costs.op_costs(engine.lower("run_rounds").compile().as_text()))


# ----------------------------------------------------------------------- pre-flight


def _bytes(shape, dtype) -> int:
    return math.prod(shape) * jnp.dtype(dtype).itemsize


def decode_floor(target, drafter, config, batch_size: int) -> dict[str, int]:
    """Buffers the fused generation must hold at once, from shapes alone (bytes).

    A lower bound of the program's new allocations, cheap to compute: nothing is
    compiled, and no array that grows with the budget, the batch or the length is
    built (`tev_jax.engine.decode_spec` reads N and L from the settings; the caches
    are shapes from ``jax.eval_shape``), so absurd settings are sized in milliseconds.
    The buffers: the target's and the drafter's KV caches (held in the loop state), the
    verify pass's float32 logits [B, N, V] (twice with each row's own sampling,
    `tev_jax.sampling.PER_ROW`: the transformed copy) and its ancestor mask [B, N, N],
    and, for the exact verifiers (all but ``greedy``), the decide stage's float32 table
    over node pairs [B, N, N] (siblings, ancestors: at wide budgets the largest buffer).

    Args:
      target, drafter: the models (real or abstract); drafter None without a tree.
      config: the `DecodeConfig`, with ``prompt_len`` set.
      batch_size: B.
    Returns:
      {'kv cache': ..., 'tree logits': ..., 'row settings': ..., 'tree mask': ...,
      'verifier pairs': ...}: bytes per buffer.
    """
    spec = decode_spec(target, drafter, config, batch_size)
    b, n, l = batch_size, spec.num_slots, spec.max_len
    caches = [jax.eval_shape(lambda: target.init_cache(b, l))]
    if spec.has_drafter:
        context = as_drafter(drafter).init_context
        caches.append(jax.eval_shape(lambda: context(target, b, l)))
    pairs = spec.has_drafter and n > 1 and config.verifier != "greedy"
    logits = _bytes((b, n, target.config.vocab_size), jnp.float32)
    return {"kv cache": sum(_bytes(x.shape, x.dtype) for x in jax.tree.leaves(caches)),
            "tree logits": logits,
            "row settings": logits if config.sampling == PER_ROW else 0,
            "tree mask": _bytes((b, n, n), jnp.bool_),
            "verifier pairs": _bytes((b, n, n), jnp.float32) if pairs else 0}


def available_bytes(devices=None) -> tuple[int, str]:
    """Free memory per device of ``devices`` (default: the first) and what it measures.

    Accelerators report ``memory_stats()['bytes_limit'] - ['bytes_in_use']`` (the least
    over ``devices``); a TPU without statistics has its chip's HBM capacity
    (`tev_jax.costs.chips.CHIPS`). The CPU backend reports nothing: there the host's available
    memory (``MemAvailable`` of /proc/meminfo, else ``os.sysconf`` free pages) is
    shared by the simulated devices, so each gets an equal part.
    """
    devices = [jax.devices()[0]] if devices is None else list(devices)
    stats = [d.memory_stats() or {} for d in devices]
    if all("bytes_limit" in st for st in stats):
        free = min(int(st["bytes_limit"]) - int(st.get("bytes_in_use", 0)) for st in stats)
        return free, f"{devices[0].device_kind} memory"
    chip = chip_of(devices[0].device_kind)
    if chip is not None:  # a TPU that reports no statistics: its published capacity
        return chip.hbm_bytes, f"{chip.name} HBM (published capacity)"
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
        host = next(int(x.split()[1]) * 1024 for x in lines if x.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    n = len(devices)
    return host // n, "host memory" + (f" (a {n}th each for {n} devices)" if n > 1 else "")


def shortfall(need_bytes: int, floor: dict[str, int], have: int, where: str, config,
              names: dict[str, str] | None = None) -> str | None:
    """One line naming the setting to lower when ``need_bytes`` exceeds ``have``, else None.

    Args:
      need_bytes: bytes the program needs (`decode_floor`'s sum, or a compiled
        program's new allocations).
      floor: `decode_floor`'s buffers; the biggest one decides the advice.
      have, where: bytes available and what they measure (`available_bytes`).
      config: the `DecodeConfig` whose settings the message names.
      names: how to name the settings ('budget', 'max_new_tokens', 'cache length',
        'batch size'), e.g. by a command's flags; default those words.
    """
    if need_bytes <= have:
        return None
    name = lambda what: (names or {}).get(what, what)
    biggest = max(floor, key=floor.get)
    if biggest != "kv cache" and config.builder == "ddtree":
        advice = f"lower {name('budget')} ({config.budget})"
    else:
        advice = (f"lower {name('max_new_tokens')} ({config.max_new_tokens}), "
                  f"{name('cache length')} or {name('batch size')}")
    parts = {k: v for k, v in floor.items() if v}
    rest = need_bytes - sum(floor.values())
    if rest > 0:
        parts["other compiled buffers"] = rest
    terms = " + ".join(f"{k} {v / GiB:.2f}" for k, v in parts.items())
    return (f"not enough memory: decoding needs {need_bytes / GiB:.2f} GiB per device "
            f"({terms} GiB) but {have / GiB:.1f} GiB of {where} is free; {advice}")


def hbm_shortfall(plan: DecodePlan, floor: dict[str, int], config) -> str | None:
    """One line naming what to lower when the whole generation's per-device peak exceeds
    its chip's HBM (`shortfall` against the chip's capacity), else None (no chip, or
    it fits)."""
    report = plan.programs.get("generation")
    if plan.chip is None or report is None:
        return None
    return shortfall(report.peak_bytes, floor, plan.chip.hbm_bytes // plan.devices_per_chip,
                     f"{plan.chip.name} HBM per device", config)


class NotEnoughMemory(ValueError):
    """A program that would not fit the device (the message is one line)."""


def check_decode_fits(target, drafter, config, batch_size: int, *, mesh=None
                      ) -> ProgramReport:
    """The pre-flight check before a generation: raises unless it fits the device.

    Per device: first `decode_floor` (its share on one of the mesh's devices) against
    `available_bytes` (`check_decode_floor`: from shapes alone, so absurd settings are
    refused at once, in milliseconds); then
    the compiled program's new allocations (outputs and scratch; the parameters are
    already resident). The compilation lands in jax's cache, so running the same
    generation next does not compile again.

    Args:
      target, drafter, config, batch_size, mesh: as for `tev_jax.engine.generate`;
        ``config.prompt_len`` must be set.
    Returns:
      The compiled program's `ProgramReport`.
    Raises:
      NotEnoughMemory: the one-line message of `shortfall`.
    """
    floor, have, where = check_decode_floor(target, drafter, config, batch_size, mesh=mesh)
    report = compile_report(
        Engine.create(target, drafter, config, batch_size, mesh=mesh).lower())
    need = report.output_bytes + report.temp_bytes - report.alias_bytes + report.code_bytes
    msg = shortfall(need, floor, have, where, config)
    if msg is not None:
        raise NotEnoughMemory(msg)
    return report


def check_decode_floor(target, drafter, config, batch_size: int, *, mesh=None,
                       names: dict[str, str] | None = None
                       ) -> tuple[dict[str, int], int, str]:
    """The first half of `check_decode_fits`, from shapes alone (milliseconds, nothing
    compiled or built in proportion to the settings): `decode_floor`'s share on the
    most loaded device of ``mesh`` against `available_bytes`; ``names``: as for
    `shortfall`.

    Returns:
      (the floor per device, bytes available, what they measure).
    Raises:
      NotEnoughMemory: the one-line message of `shortfall`.
    """
    if config.prompt_len is None:
        raise ValueError("the pre-flight check needs DecodeConfig.prompt_len")
    devices = None if mesh is None else mesh.devices.flat
    n = 1 if mesh is None else mesh.devices.size
    # the most loaded device holds at least an n-th of every buffer
    floor = {k: -(-v // n) for k, v in decode_floor(target, drafter, config, batch_size).items()}
    have, where = available_bytes(devices)
    msg = shortfall(sum(floor.values()), floor, have, where, config, names)
    if msg is not None:
        raise NotEnoughMemory(msg)
    return floor, have, where


__all__ = ["DECODE_PROGRAMS", "DecodePlan", "GiB", "NotEnoughMemory", "PRESETS",
           "ProgramReport", "abstract_drafter", "abstract_models", "abstract_target",
           "available_bytes", "check_decode_fits", "check_decode_floor", "compile_report",
           "decode_floor", "drafter_config", "hbm_shortfall", "loop_ops", "model_config",
           "plan_decode", "plan_decode_programs", "plan_serving", "preset", "round_floor",
           "shortfall", "sum_floor", "with_layers"]
