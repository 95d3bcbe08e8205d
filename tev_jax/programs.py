"""The engine's programs, jitted once: the decode functions of `tev_jax.decode` and
`tev_jax.decode_slots` under ``jax.jit``, with the `tev_jax.decode.DecodeSpec` (hashable)
and the graphdef static, so every engine with the same spec and architecture shares a
compilation; a state argument that a program replaces is donated. The stage programs
of the un-fused path (`stage_jit`) are compiled once per setting of the config fields
each stage reads. `tev_jax.engine.Engine` calls them with its models and shapes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from tev_jax import decode, decode_slots, extensions
from tev_jax.decode import DecodeConfig, DecodeSpec


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def generate_jit(graphdef, params, tokens_BT, lengths_B, key, sampling_B=None, *, spec):
    return decode.generation(graphdef, params, tokens_BT, lengths_B, key, sampling_B,
                             spec=spec)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def prefill_jit(graphdef, params, tokens_BT, lengths_B, key, sampling_B=None, *, spec):
    drafter = decode.merge_models(graphdef, params)[1]
    st = decode.prefill(graphdef, params, tokens_BT, lengths_B,
                        decode.row_keys(key, jnp.arange(tokens_BT.shape[0])), sampling_B,
                        spec=spec)
    return decode.constrain_state(st, drafter, spec)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"), donate_argnames=("st",))
def round_jit(graphdef, params, st, *, spec):
    drafter = decode.merge_models(graphdef, params)[1]
    return decode.constrain_state(decode.decode_round(graphdef, params, st, spec=spec),
                                  drafter, spec)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"), donate_argnames=("st",))
def traced_round_jit(graphdef, params, st, *, spec):
    drafter = decode.merge_models(graphdef, params)[1]
    st, record = decode.traced_round(graphdef, params, st, spec=spec)
    return decode.constrain_state(st, drafter, spec), record


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"), donate_argnames=("st",))
def run_jit(graphdef, params, st, *, spec):
    m = spec.config.max_new_tokens
    return decode.rounds_until(graphdef, params, st, spec.batch_size, m - st.round, spec=spec)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "axes"),
                   donate_argnames=("st",))
def refill_jit(graphdef, params, st, tokens_KT, lengths_K, slots_K, key_K, sampling_K, *,
                spec, axes):
    return decode_slots.refill(graphdef, params, st, tokens_KT, lengths_K, slots_K, key_K,
                               sampling_K, spec=spec, axes=axes)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "axes"),
                   donate_argnames=("st",))
def put_rows_jit(graphdef, params, st, rows, slots_K, *, spec, axes):
    return decode_slots.put_rows(graphdef, params, st, rows, slots_K, spec=spec, axes=axes)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "axes"))
def take_rows_jit(graphdef, params, st, rows_K, *, spec, axes):
    return decode_slots.take_rows(graphdef, params, st, rows_K, spec=spec, axes=axes)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"), donate_argnames=("st",))
def run_rounds_jit(graphdef, params, st, until_done, max_rounds, *, spec):
    return decode.rounds_until(graphdef, params, st, until_done, max_rounds, spec=spec)


# The config fields each stage reads; the others are reset to their defaults so that
# configurations differing only elsewhere share that stage's compilation.
_STAGE_FIELDS = {
    "draft": (),
    "build": ("builder", "budget"),
    "verify": (),
    "decide": ("builder", "verifier", "sampling"),
    "commit": ("max_new_tokens", "stop_token_ids", "track_exit_law", "sampling"),
}
_CANONICAL = DecodeConfig(verifier="tev")
_STAGE_FNS = {"draft": decode.draft_stage, "build": decode.build_stage,
              "verify": decode.verify_stage, "decide": decode.decide_stage,
              "commit": decode.commit_stage}
_MODEL_STAGES = ("draft", "verify")


def _stage_spec(spec: DecodeSpec, stage: str) -> DecodeSpec:
    """``spec`` with only the config fields ``stage`` reads (shared compilations)."""
    keep = {f: getattr(spec.config, f) for f in _STAGE_FIELDS[stage]}
    if stage == "draft":  # draft only asks whether the builder reads the block
        builder = extensions.resolve_builder(spec.config.builder, spec.config.budget)
        keep["builder"] = "ddtree" if extensions.reads_draft_logits(builder) else "none"
    if stage == "decide" and keep["builder"] != "none":
        keep["builder"] = "chain"  # decide only asks whether there is a tree
    if stage == "commit" and not keep["track_exit_law"]:
        keep.pop("sampling")
    if "verifier" not in keep and "sampling" in keep:
        keep["verifier"] = "tev"  # any verifier is valid with any sampling
    return dataclasses.replace(spec, config=dataclasses.replace(_CANONICAL, **keep),
                               num_slots=0, prompt_len=0, batch_size=0)


def stage_jit(stage: str, spec: DecodeSpec, graphdef=None):
    """The jitted program of one stage (`tev_jax.decode.STAGES`) for ``spec``, compiled
    once per setting of the config fields it reads; the models' stages (draft, verify)
    have ``graphdef`` bound."""
    if stage not in _STAGE_FNS:
        raise ValueError(f"stage must be one of {decode.STAGES}, got {stage!r}")
    return _stage_jit(stage, _stage_spec(spec, stage),
                      graphdef if stage in _MODEL_STAGES else None)


@functools.lru_cache(maxsize=None)
def _stage_jit(stage: str, spec: DecodeSpec, graphdef=None):
    # The graphdef is bound here rather than passed as a static argument: hashing it on
    # every call would add a dispatch cost that dwarfs small stages.
    fn = _STAGE_FNS[stage]
    if stage in _MODEL_STAGES:
        return jax.jit(functools.partial(fn, graphdef, spec=spec))
    return jax.jit(functools.partial(fn, spec=spec))


__all__ = ["generate_jit", "prefill_jit", "put_rows_jit", "refill_jit", "round_jit",
           "run_jit", "run_rounds_jit", "stage_jit", "take_rows_jit", "traced_round_jit"]
