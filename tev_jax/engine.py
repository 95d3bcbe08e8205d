"""The decode engine: one object that owns the shapes and hands out the programs.

`Engine.create` checks a (target, drafter, config, batch size, mesh) once, splits and
places the models, and fixes every shape (`DecodeSpec`: horizon H, tree slots N, cache
length L, prompt buffer P). Its methods are the programs of `tev_jax.decode`, jitted
once in `tev_jax.programs`::

    engine = Engine.create(target, drafter, DecodeConfig(budget=64), batch_size=8)
    prompts = engine.prompts(prompt_ids)            # host checks, padding, placement
    gen = engine.finish(engine.generate(prompts, key))   # prefill + fused loop, one program

    st = engine.prefill(prompts, key)                # or step by step
    st = engine.round(st)                            # one round (draft ... commit)
    st, record = engine.traced_round(st)             # ... and what it did (tev_jax.trace)
    st = engine.run(st)                              # the fused loop to the end
    gen = engine.trace(prompts, key)                 # generate, with gen.trace per round

    engine.lower("round").compile().memory_analysis()   # any program, ahead of time

The programs are compiled once per spec and shape (`tev_jax.programs`) and shared by
every engine with the same spec (two engines with equal configs reuse one compilation). The engine is frozen;
`with_models` swaps in other weights of the same architecture without recompiling.
`generate` and `generate_ar` are the one-call forms; `tev_jax.batch.continuous` drives the slot
programs (`empty_slots`, `refill`, `run_rounds`, `take_slots`), `tev_jax.costs.timing` times
the fused program and the stage programs (`stage`), and `tev_jax.costs.plan` compiles the
`lower` of each. An automatic budget (`tev_jax.budget.AutoBudget`, from `tev_jax.costs.tune`)
is resolved to a fixed one before an engine is built (`tev_jax.budget.resolve_budget`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tev_jax import decode, extensions, programs
from tev_jax import sharding as shd
from tev_jax.budget import AutoBudget, resolve_budget
from tev_jax.decode import DecodeConfig, DecodeSpec, DecodeState
from tev_jax.drafters import DrafterProtocol, as_drafter
from tev_jax.generation import DecodeStats, Generation
from tev_jax.models import kv_heads
from tev_jax.models import layer_layout as layer_layouts
from tev_jax.prompts import Prompts, check_prompts
from tev_jax.sampling import PER_ROW, Sampling, SamplingRows
from tev_jax.trace import RoundRecord, RoundTrace, stack_records

PROGRAMS = ("generate", "prefill", "round", "run_rounds", *decode.STAGES)
"""The names `Engine.lower` takes: the whole generation, the prefill, one round, the
rounds program of continuous batching and each stage of a round."""


def _place(tree, shardings):
    """``device_put`` of arrays, and shardings attached to abstract leaves."""
    def one(x, sharding):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return jax.device_put(x, sharding)

    return jax.tree.map(one, tree, shardings)


def _abstract(tree):
    """Every leaf as a ``jax.ShapeDtypeStruct`` that keeps its sharding."""
    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(one, tree)


def _laid_out(params, layout: str):
    """The engine's parameters with the target's layers in ``layout`` (element 0 of
    ``(target, drafter)``; the drafter's layers are trained stacked and stay so)."""
    if layout != "per_layer":
        return params
    params[0] = layer_layouts.per_layer(params[0])
    return params


def _mesh_scope(mesh):
    """``jax.set_mesh(mesh)`` (activates the models' activation constraints), or nothing."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def _heads_for(target, drafter, mesh):
    """Target and drafter with key/value heads the mesh splits (`kv_heads.for_mesh`)."""
    return (kv_heads.for_mesh(target, mesh),
            None if drafter is None else kv_heads.for_mesh(drafter, mesh))


def _spec_of(target, drafter, config: DecodeConfig, batch_size: int, prompt_len: int,
             mesh) -> tuple[Any, DecodeSpec]:
    """Validates models, config and mesh; -> (drafter as a protocol or None, spec)."""
    if not isinstance(config, DecodeConfig):
        raise ValueError(f"config must be a DecodeConfig, got {type(config).__name__}")
    if isinstance(config.budget, AutoBudget):
        raise ValueError("an engine needs a fixed budget: resolve budget='auto' for the "
                         "batch first (tev_jax.budget.resolve_budget)")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if not isinstance(prompt_len, int) or prompt_len < 1:
        raise ValueError(f"prompt_len must be a positive int, got {prompt_len!r}")
    vocab = target.config.vocab_size
    for s in config.stop_token_ids:
        if not isinstance(s, (int, np.integer)) or not 0 <= s < vocab:
            raise ValueError(f"stop token id {s!r} is outside the vocabulary [0, {vocab})")
    if config.builder == "none":
        horizon, taps, drafter = 0, (), None
    else:
        drafter = as_drafter(drafter)
        if drafter is None:
            raise ValueError(f"builder={config.builder!r} needs a drafter (or use builder='none')")
        horizon = int(drafter.block_size) - 1
        if horizon < 1:
            raise ValueError(f"drafter block_size must be >= 2, got {drafter.block_size}")
        taps = tuple(int(t) for t in drafter.target_layer_ids)
        for t in taps:
            if not 0 <= t < target.config.num_layers:
                raise ValueError(f"drafter taps target layer {t}, but the target has "
                                 f"{target.config.num_layers} layers")
    builder = extensions.resolve_builder(config.builder, config.budget)
    num_slots = extensions.builder_num_slots(builder, horizon, vocab)
    if callable(config.verifier) and config.builder != "none":
        extensions.check_verifier(config.verifier, num_slots, horizon, vocab,
                                  Sampling(1.0) if config.sampling == PER_ROW
                                  else config.sampling)
    need = prompt_len + config.max_new_tokens + num_slots
    max_len = decode.aligned_len(need) if config.max_cache_len is None else config.max_cache_len
    if max_len < need:
        raise ValueError(
            f"the cache is too short: the prompt buffer ({prompt_len} tokens) + "
            f"max_new_tokens ({config.max_new_tokens}) + tree slots ({num_slots}) = "
            f"{need} > max_cache_len ({max_len})")
    if mesh is not None:
        shd.logical_to_spec(("batch",), (batch_size,), mesh, strict=True,
                            what=f"the batch of {batch_size} prompts")
    return drafter, DecodeSpec(config=config, batch_size=batch_size, prompt_len=prompt_len,
                               horizon=horizon, num_slots=num_slots, taps=taps,
                               max_len=max_len, has_drafter=drafter is not None, mesh=mesh)


def _width(config: DecodeConfig, prompt_len: int | None) -> int:
    width = getattr(config, "prompt_len", None) if prompt_len is None else prompt_len
    if width is None:
        raise ValueError("Engine.create needs a prompt buffer: set prompt_len (or "
                         "DecodeConfig.prompt_len); it decides the cache length")
    if (isinstance(config, DecodeConfig) and config.prompt_len is not None
            and width != config.prompt_len):
        raise ValueError(f"prompt_len {width} differs from DecodeConfig.prompt_len "
                         f"({config.prompt_len}); give one of them")
    return width


def decode_spec(target, drafter, config: DecodeConfig, batch_size: int, *,
                prompt_len: int | None = None, mesh=None) -> DecodeSpec:
    """The `DecodeSpec` that `Engine.create` would fix for these arguments, with the
    same checks, from shapes alone: nothing is split, placed, traced in proportion to
    the budget, or compiled (the pre-flight check of `tev_jax.costs.plan` sizes buffers
    from it in milliseconds, for any budget, batch or length).

    Raises:
      ValueError: as `Engine.create`.
    """
    return _spec_of(target, drafter, config, batch_size, _width(config, prompt_len), mesh)[1]


# --------------------------------------------------------------------------- engine


@dataclasses.dataclass(frozen=True, eq=False)
class Engine:
    """Speculative (or plain AR) decoding of B rows with fixed shapes, as programs.

    Build with `Engine.create`. Concrete models give runnable programs; abstract ones
    (``nnx.eval_shape``) give only `lower`, for planning memory on any slice.

    Attributes:
      graphdef: the split ``(target,)`` or ``(target, drafter)``.
      params: their parameters (placed on the mesh; ``jax.ShapeDtypeStruct`` leaves for
        abstract models).
      spec: the `DecodeSpec`: config, B, P, H, N, L, taps, mesh.
      drafter: the `DrafterProtocol` of the drafter (None for AR).
      vocab_size: V, the target's vocabulary.
    """

    graphdef: Any
    params: Any
    spec: DecodeSpec
    drafter: DrafterProtocol | None
    vocab_size: int
    layer_layout: str = "stacked"

    @classmethod
    def create(cls, target, drafter, config: DecodeConfig, batch_size: int, *,
               prompt_len: int | None = None, mesh=None,
               layer_layout: layer_layouts.LayerLayout = "auto") -> Engine:
        """Checks everything once and fixes the shapes.

        Args:
          target: a `tev_jax.models.Target` (concrete or abstract).
          drafter: a DFlash drafter or any `tev_jax.drafters.DrafterProtocol`; None
            with ``builder='none'`` (it is ignored then).
          config: a `DecodeConfig`.
          batch_size: B, rows decoded together (or row slots of continuous batching).
          prompt_len: P, the prompt buffer the cache is sized for; default
            ``config.prompt_len`` (one of the two is required).
          mesh: optional ``('data', 'fsdp', 'tensor')`` mesh
            (`tev_jax.sharding.make_mesh`). The parameters are placed by their logical
            axes strictly (a dimension the mesh does not divide is an error); both
            caches and the loop state get explicit shardings: batch rows over data and
            fsdp; heads, MLP and vocabulary over tensor; parameters' ``embed`` axis over
            fsdp (gathered when used: use ``data`` to keep weights whole per device).
            Where the tensor axis is wider than the models' key/value heads, each head
            is taken as often as it needs to split (`tev_jax.models.kv_heads`: the same
            models, a larger cache).
          layer_layout: how the target's layer weights are held: ``'stacked'`` (one
            array per parameter, the layers run as one scan), ``'per_layer'`` (one
            array per layer, a loop over the layers: each GEMM reads its weights in
            place, at the cost of a program per layer and a copy of the layer weights
            held by the engine, `tev_jax.models.layer_layout`) or ``'auto'``: per layer
            on GPUs, stacked elsewhere.

        Raises:
          ValueError: a bad config, batch size, prompt buffer or layer layout; a cache
            too short for P + M + N; a missing or malformed drafter, builder or
            verifier; a mesh that does not divide a dimension (named in the message).
        """
        devices = jax.devices() if mesh is None else mesh.devices.flat
        layer_layout = layer_layouts.choose(layer_layout, devices[0].platform)
        if mesh is not None:
            target, drafter = _heads_for(target, drafter, mesh)
        drafter, spec = _spec_of(target, drafter, config, batch_size,
                                 _width(config, prompt_len), mesh)
        graphdef, params = nnx.split((target,) if drafter is None else (target, drafter))
        if mesh is not None:
            params = _place(params, shd.state_shardings(params, mesh, strict=True))
        return cls(graphdef=graphdef, params=_laid_out(params, layer_layout), spec=spec,
                   drafter=drafter, vocab_size=target.config.vocab_size,
                   layer_layout=layer_layout)

    def with_models(self, target, drafter=None) -> Engine:
        """The same engine (same spec and compilations) over other weights of the same
        architecture; a ValueError if the architecture differs."""
        if self.mesh is not None:
            target, drafter = _heads_for(target, drafter, self.mesh)
        drafter = None if self.drafter is None else as_drafter(drafter)
        graphdef, params = nnx.split((target,) if drafter is None else (target, drafter))
        if graphdef != self.graphdef:
            raise ValueError("these models' architecture differs from the engine's")
        if self.mesh is not None:
            params = _place(params, shd.state_shardings(params, self.mesh, strict=True))
        return dataclasses.replace(self, params=_laid_out(params, self.layer_layout),
                                   drafter=drafter)

    @property
    def config(self) -> DecodeConfig:
        return self.spec.config

    @property
    def mesh(self):
        return self.spec.mesh

    # --------------------------------------------------------------------- programs

    def prompts(self, prompt_ids: Sequence[Sequence[int]],
                sampling: Sampling | Sequence[Sampling] | None = None) -> Prompts:
        """Host checks of B prompts, zero-padded and placed as the programs expect.

        The padding width is P with ``config.prompt_len`` set, else the longest prompt
        rounded up to a multiple of 8 (so prompts of similar lengths share a program).
        ``sampling``: with ``DecodeConfig(sampling=PER_ROW)``, each prompt's `Sampling`
        (or one for all); other configs sample with theirs and take none.
        """
        prompts = check_prompts(prompt_ids, self.vocab_size, self.spec.prompt_len)
        if len(prompts) != self.spec.batch_size:
            raise ValueError(f"the engine decodes {self.spec.batch_size} prompts at a time, "
                             f"got {len(prompts)}")
        width = (self.config.prompt_len if self.config.prompt_len is not None
                 else min(decode.aligned_len(max(len(p) for p in prompts)), self.spec.max_len))
        tokens_BT = np.zeros((len(prompts), width), np.int32)
        for i, p in enumerate(prompts):
            tokens_BT[i, : len(p)] = p
        lengths_B = np.asarray([len(p) for p in prompts], np.int32)
        return Prompts(*(self._rows(x) for x in (tokens_BT, lengths_B)),
                       self.row_settings(sampling, len(prompts)))

    def row_settings(self, sampling: Sampling | Sequence[Sampling] | SamplingRows | None,
                     rows: int) -> SamplingRows | None:
        """``rows`` rows' settings for the programs: placed `SamplingRows` with
        ``sampling=PER_ROW`` (``sampling`` one `Sampling`, one per row, or the
        `SamplingRows` themselves), else None (and ``sampling`` must be None)."""
        if self.config.sampling != PER_ROW:
            if sampling is not None:
                raise ValueError(f"this engine samples every row with "
                                 f"{self.config.sampling}; per-row settings need "
                                 "DecodeConfig(sampling='per_row')")
            return None
        if sampling is None:
            raise ValueError("a sampling='per_row' engine needs each prompt's setting: "
                             "prompts(ids, sampling=[Sampling(...), ...])")
        if not isinstance(sampling, SamplingRows):
            settings = [sampling] * rows if isinstance(sampling, Sampling) else list(sampling)
            sampling = SamplingRows.of(settings)
        if sampling.temperature.shape != (rows,):
            raise ValueError(f"{sampling.temperature.shape[0]} sampling settings for {rows} "
                             "prompts")
        return jax.tree.map(lambda x: self._rows(np.asarray(x)), sampling)

    def _rows(self, x: np.ndarray) -> jax.Array:
        if self.mesh is None:
            return jnp.asarray(x)
        names = ("batch",) + (None,) * (x.ndim - 1)
        return jax.device_put(x, shd.logical_sharding(names, x.shape, self.mesh))

    def _call(self, fn, *args, **kw):
        with _mesh_scope(self.mesh):
            return fn(self.graphdef, self.params, *args, spec=self.spec, **kw)

    def generate(self, prompts: Prompts, key: jax.Array) -> DecodeState:
        """The whole generation as one program: prefill + the fused loop."""
        return self._call(programs.generate_jit, prompts.tokens_BT, prompts.lengths_B, key,
                          prompts.sampling_B)

    def prefill(self, prompts: Prompts, key: jax.Array) -> DecodeState:
        """Consumes the prompts and samples each row's first token (row b's key is
        ``decode.row_keys(key, [b])``)."""
        return self._call(programs.prefill_jit, prompts.tokens_BT, prompts.lengths_B, key,
                          prompts.sampling_B)

    def round(self, st: DecodeState) -> DecodeState:
        """One round (draft, build, verify, decide, commit); ``st`` is donated."""
        return self._call(programs.round_jit, st)

    def run(self, st: DecodeState) -> DecodeState:
        """The fused loop from ``st`` until every row is done (or M rounds ran); ``st``
        is donated. ``run(prefill(p, k))`` gives what ``generate(p, k)`` gives."""
        return self._call(programs.run_jit, st)

    def traced_round(self, st: DecodeState) -> tuple[DecodeState, RoundRecord]:
        """`round` that also returns what the round did: its `tev_jax.trace.RoundRecord`
        (tree, draft log-probabilities, verdict); ``st`` is donated."""
        return self._call(programs.traced_round_jit, st)

    def trace(self, prompts: Prompts, key: jax.Array) -> Generation:
        """The generation of `generate` (same tokens for the same key), round by round,
        with ``Generation.trace`` holding every round's record stacked per round
        (`tev_jax.trace.RoundTrace`; the key schedule is stated there)."""
        st = self.prefill(prompts, key)
        records = []
        m = self.config.max_new_tokens
        while int(st.round) < m and bool(np.any(~np.asarray(st.done_B))):
            st, record = self.traced_round(st)
            records.append(jax.device_get(record))
        return self.finish(st, trace=stack_records(records))

    def finish(self, st: DecodeState, *, trace: RoundTrace | None = None,
               **stats) -> Generation:
        """The host side of a final state: NaN checks and the `Generation`.

        Args:
          st: a final `DecodeState`.
          trace: its rounds' `tev_jax.trace.RoundTrace`, if recorded.
          **stats: extra `DecodeStats` fields (``seconds``, ``stage_seconds``, ...).
        Raises:
          ValueError: the target or the drafter produced non-finite logits.
        """
        if bool(st.bad_target):
            raise ValueError("the target produced non-finite logits (NaN or +inf) during "
                             "generation; the output would be garbage")
        if bool(st.bad_draft):
            raise ValueError("the drafter produced non-finite logits (NaN or +inf) during "
                             "generation; its trees would be garbage")
        rounds = int(st.round)
        return Generation(
            tokens=np.asarray(st.out_BM),
            lengths=np.asarray(st.num_out_B),
            stats=DecodeStats(
                rounds=rounds,
                rounds_per_row=np.asarray(st.rounds_B),
                kv_moves=np.asarray(st.moved_B),
                block_lengths=np.asarray(st.block_len_RB)[:rounds],
                expected_lengths=(np.asarray(st.expected_len_RB)[:rounds]
                                  if self.config.track_exit_law else None),
                experts_touched=(np.asarray(st.experts_RL)[:rounds]
                                 if st.experts_RL.shape[1] else None),
                **stats,
            ),
            trace=trace,
        )

    def stage(self, name: str) -> Callable:
        """The jitted program of one stage (`tev_jax.decode.STAGES`), for the un-fused
        path of `tev_jax.costs.timing`; its models are bound (call it without graphdef).

        Signatures (as the stage functions of `tev_jax.decode`, params first where
        the stage runs a model): ``draft(params, st) -> (logits_BHV, ctx)``,
        ``build(logits_BHV, root_B) -> tree``, ``verify(params, cache, tree, start_B)
        -> (logits_BNV, feats, cache)``, ``decide(key_B, tree, logits_BNV[,
        sampling_B]) -> verdict`` (``key_B``: `tev_jax.decode.round_step_keys` of the
        state; ``sampling_B``: its ``sampling_B`` with ``sampling=PER_ROW``), ``commit(st, ctx,
        logits_BHV, tree, logits_BNV, feats, cache, verdict)``.
        A stage is compiled once per setting of the config fields it reads.
        """
        return programs.stage_jit(name, self.spec, self.graphdef)

    # ------------------------------------------------------------ continuous batching

    def slot_axes(self) -> tuple[int | None, ...]:
        """The row axis of every `DecodeState` leaf (for `refill`)."""
        with _mesh_scope(self.mesh):
            return programs.row_axes(self.graphdef, self.params, spec=self.spec)

    def empty_slots(self, key: jax.Array) -> DecodeState:
        """A state of B free slots (every row done, nothing in flight)."""
        with _mesh_scope(self.mesh):
            return programs.empty_state(self.graphdef, self.params, key, spec=self.spec)

    def refill(self, st: DecodeState, tokens_KT, lengths_K, slots_K, key_K,
               sampling_K: Sampling | Sequence[Sampling] | SamplingRows | None = None, *,
               axes: tuple[int | None, ...]) -> DecodeState:
        """Prefills K prompts into the given slots of ``st`` (donated), prompt k with the
        row key ``key_K[k]`` and, with ``sampling=PER_ROW``, the setting
        ``sampling_K[k]`` (`row_settings`); see `tev_jax.programs.refill`. ``axes`` is
        `slot_axes`."""
        return self._call(programs.refill_jit, st, tokens_KT, lengths_K, slots_K, key_K,
                          self.row_settings(sampling_K, len(lengths_K)), axes=axes)

    def take_slots(self, st: DecodeState, rows, *, axes: tuple[int | None, ...]
                   ) -> DecodeState:
        """This engine's B slots filled with the rows ``rows`` (B indices) of a state of
        another engine with the same shapes but more slots (an engine of the same
        models and cache length): continuous batching moves its last running rows onto
        a smaller program. ``axes`` is `slot_axes`."""
        rows = np.asarray(rows, np.int32)
        if rows.shape != (self.spec.batch_size,):
            raise ValueError(f"take_slots needs {self.spec.batch_size} row indices, got "
                             f"shape {rows.shape}")
        return self._call(programs.take_rows_jit, st, jnp.asarray(rows), axes=axes)

    def put_slots(self, st: DecodeState, rows: DecodeState, slots, *,
                  axes: tuple[int | None, ...]) -> DecodeState:
        """The rows of ``rows`` (a state of another engine with the same shapes but fewer
        slots) written into the slots ``slots`` (one index per row) of ``st`` (this
        engine's, donated): the inverse of `take_slots`, for a server whose live rows
        outgrow a smaller program. ``axes`` is `slot_axes`."""
        slots = np.asarray(slots, np.int32)
        if slots.shape != (rows.done_B.shape[0],):
            raise ValueError(f"put_slots needs one slot per row ({rows.done_B.shape[0]}), got "
                             f"shape {slots.shape}")
        return self._call(programs.put_rows_jit, st, rows, jnp.asarray(slots), axes=axes)

    def run_rounds(self, st: DecodeState, until_done: int, max_rounds: int) -> DecodeState:
        """Runs rounds until ``until_done`` rows are done, all are, or ``max_rounds``
        ran. Both bounds are traced, so every call reuses one compilation; ``st`` is
        donated."""
        return self._call(programs.run_rounds_jit, st, jnp.int32(until_done), jnp.int32(max_rounds))

    # ------------------------------------------------------------------- lowering

    def abstract_prompts(self, width: int | None = None) -> Prompts:
        """Abstract prompts of the engine's batch (``width`` default: P)."""
        b, t = self.spec.batch_size, width or self.spec.prompt_len
        rows = lambda *shape: (None if self.mesh is None else shd.logical_sharding(
            ("batch",) + (None,) * (len(shape) - 1), shape, self.mesh))
        settings = programs.abstract_rows(b, self.spec)
        return Prompts(jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rows(b, t)),
                       jax.ShapeDtypeStruct((b,), jnp.int32, sharding=rows(b)),
                       None if settings is None else jax.tree.map(
                           lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                          sharding=rows(b)), settings))

    def abstract_state(self) -> DecodeState:
        """The abstract `DecodeState` after the prefill, with the loop's shardings."""
        with _mesh_scope(self.mesh):
            prompts = self.abstract_prompts()
            st = jax.eval_shape(
                functools.partial(programs.prefill_jit, self.graphdef, spec=self.spec),
                _abstract(self.params), prompts.tokens_BT, prompts.lengths_B,
                jax.eval_shape(lambda: jax.random.key(0)), prompts.sampling_B)
        return st

    def lower(self, program: str = "generate") -> jax.stages.Lowered:
        """The jax ``Lowered`` of one program, on abstract arguments.

        Works on abstract models, so ``lower(...).compile()`` plans memory
        (``memory_analysis()``: per-device argument, output and temporary bytes) and
        cost (``cost_analysis()``) for models that do not fit this host.

        Args:
          program: one of `PROGRAMS`: 'generate' (prefill + fused loop: what must fit),
            'prefill' (prompt buffer P), 'round' (one fused round), 'run_rounds' (the
            rounds program of continuous batching over B slots), or a stage name
            ('draft', 'build', 'verify', 'decide', 'commit'), lowered on the shapes
            one round gives it.
        Raises:
          ValueError: an unknown program name.
        """
        if program not in PROGRAMS:
            raise ValueError(f"program must be one of {PROGRAMS}, got {program!r}")
        params = _abstract(self.params)
        key = jax.eval_shape(lambda: jax.random.key(0))
        with _mesh_scope(self.mesh):
            if program in ("generate", "prefill"):
                fn = programs.generate_jit if program == "generate" else programs.prefill_jit
                prompts = self.abstract_prompts()
                # the rows' settings with sampling=PER_ROW only: a static setting's program
                # takes (params, tokens, lengths, key)
                settings = () if prompts.sampling_B is None else (prompts.sampling_B,)
                return fn.lower(self.graphdef, params, prompts.tokens_BT, prompts.lengths_B,
                                key, *settings, spec=self.spec)
            st = self.abstract_state()
            if program == "round":
                return programs.round_jit.lower(self.graphdef, params, st, spec=self.spec)
            if program == "run_rounds":
                bound = jax.ShapeDtypeStruct((), jnp.int32)
                return programs.run_rounds_jit.lower(self.graphdef, params, st, bound, bound,
                                             spec=self.spec)
            args = self._stage_args(program, params, st)
            return self.stage(program).lower(*args)

    def _stage_args(self, program: str, params, st: DecodeState) -> tuple:
        """Abstract arguments of one stage: what the stages before it give in a round."""
        shape = lambda stage, *args: jax.eval_shape(self.stage(stage), *args)
        if self.spec.has_drafter:
            draft_logits, ctx = shape("draft", params, st)
        else:
            draft_logits, ctx = None, st.ctx
        tree = shape("build", draft_logits, st.root_B)
        logits, feats, cache, experts = shape("verify", params, st.cache, tree, st.start_B)
        settings = () if st.sampling_B is None else (st.sampling_B,)
        verdict = shape("decide", st.key_B, tree, logits, *settings)
        return {
            "draft": (params, st),
            "build": (draft_logits, st.root_B),
            "verify": (params, st.cache, tree, st.start_B),
            "decide": (st.key_B, tree, logits, *settings),
            "commit": (st, ctx, draft_logits, tree, logits, feats, cache, verdict, experts),
        }[program]


# ------------------------------------------------------------------- one-call forms


def as_key(key) -> jax.Array:
    """A PRNG key from a seed (an int), or the key itself."""
    return jax.random.key(key) if isinstance(key, int) else key


def engine_for(target, drafter, prompt_ids, config: DecodeConfig, *, mesh=None
               ) -> tuple[Engine, Prompts]:
    """The engine for one batch of prompts (its buffer: ``config.prompt_len`` or the
    longest prompt) and the placed prompts; an automatic budget is resolved for the
    batch (`tev_jax.budget.resolve_budget`)."""
    if not isinstance(config, DecodeConfig):
        raise ValueError(f"config must be a DecodeConfig, got {type(config).__name__}")
    checked = check_prompts(prompt_ids, target.config.vocab_size, config.prompt_len)
    config = resolve_budget(config, len(checked), target, drafter)
    width = config.prompt_len or max(len(p) for p in checked)
    engine = Engine.create(target, drafter, config, len(checked), prompt_len=width, mesh=mesh)
    return engine, engine.prompts(prompt_ids)


def generate(target, drafter: DrafterProtocol | None, prompt_ids: Sequence[Sequence[int]],
             config: DecodeConfig, key: jax.Array | int = 0, *, mesh=None,
             trace: bool = False) -> Generation:
    """Generates up to ``config.max_new_tokens`` tokens per prompt (the fused program).

    Args:
      target: a `tev_jax.models.Target`.
      drafter: a DFlash drafter or any `tev_jax.drafters.DrafterProtocol`; None with
        ``builder='none'``.
      prompt_ids: B prompts, each a non-empty list of token ids (lengths may differ).
      config: a `DecodeConfig`.
      key: PRNG key or int seed.
      mesh: optional mesh (see `Engine.create`). The tokens equal the single-device run's.
      trace: also record every round's tree, draft log-probabilities and verdict
        (`Engine.trace`: round by round instead of one fused program; same tokens).

    Returns:
      A `Generation`: tokens [B, M] (generated only, -1 padded), lengths [B], stats,
      and with ``trace`` its `tev_jax.trace.RoundTrace`.

    Raises:
      ValueError: an empty prompt list or prompt, a token id outside the vocabulary, a
        cache too short for prompt + M + N, a missing drafter, a mesh that does not
        divide a dimension (the batch, heads, vocabulary, ...: named in the message),
        or non-finite logits seen during generation.
    """
    engine, prompts = engine_for(target, drafter, prompt_ids, config, mesh=mesh)
    if trace:
        return engine.trace(prompts, as_key(key))
    return engine.finish(engine.generate(prompts, as_key(key)))


def generate_ar(target, prompt_ids: Sequence[Sequence[int]], config: DecodeConfig,
                key: jax.Array | int = 0, *, mesh=None) -> Generation:
    """Plain autoregressive decoding from the target (the baseline and the reference).

    Same cache, prefill and stopping as `generate`; one target token per round.
    """
    return generate(target, None, prompt_ids, dataclasses.replace(config, builder="none"), key,
                    mesh=mesh)


__all__ = ["PROGRAMS", "Engine", "as_key", "decode_spec", "engine_for", "generate", "generate_ar"]
