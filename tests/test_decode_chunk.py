"""DecodeConfig.prefill_chunk: a chunked prefill decodes the same tokens."""

from __future__ import annotations

from tev_jax import decode, engine
from tev_jax.engine import Engine
from decode_fixtures import tiny_target


def test_prefill_chunk_gives_the_same_generation():
    target = tiny_target()
    prompts = [list(range(1, 20)), [5, 6, 7], list(range(30, 41))]
    cfg = decode.DecodeConfig(max_new_tokens=6, builder="none", prompt_len=24)
    ref = engine.generate_ar(target, prompts, cfg)
    for chunk in (5, 8):   # 24 / 5 is not whole: the last chunk is padding
        out = engine.generate_ar(target, prompts, decode.DecodeConfig(
            max_new_tokens=6, builder="none", prompt_len=24, prefill_chunk=chunk))
        assert out.rows() == ref.rows()


def test_prefill_chunk_bounds_prefill_memory():
    """The chunked program's scratch memory does not grow with the prompt buffer."""
    target = tiny_target()

    def temp(prompt_len, chunk):
        cfg = decode.DecodeConfig(max_new_tokens=2, builder="none", prompt_len=prompt_len,
                                  prefill_chunk=chunk)
        lowered = Engine.create(target, None, cfg, 4).lower()
        return lowered.compile().memory_analysis().temp_size_in_bytes

    assert temp(1024, 64) < 0.5 * temp(1024, None)
