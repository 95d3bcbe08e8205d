"""The contract of `tev_jax.engine.Engine`, on a tiny target and drafter (V = 64, H = 3).

An engine fixes its shapes: B prompts at a time, a prompt buffer of P tokens, M output
tokens per row; a prompt longer than P or a batch of another size is refused with a
ValueError naming it. Every program it hands out gives the tokens of
`tev_jax.engine.generate` and of a cache-free greedy reference (`greedy_reference`, no
engine) at T = 0: the fused `generate`; `prefill`, `round` and `run`; the slot programs
of continuous batching (`empty_slots`, `refill`, `run_rounds`, `slot_axes`) row by row;
and `take_slots` / `put_slots`, which move rows in flight between engines of different
slot counts without changing their tokens. `lower` needs no weights: an engine of
abstract models lowers, and its compiled program, run on the concrete weights, is the
concrete engine's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_fixtures import greedy_reference, tiny_target
from flax import nnx

from tev_jax import engine, programs
from tev_jax.decode import DecodeConfig
from tev_jax.engine import Engine
from tev_jax.models.drafter_io import init_drafter

V, H, P, M, B = 64, 3, 16, 8, 2
CONFIG = DecodeConfig(max_new_tokens=M, budget=6, prompt_len=P)
PROMPTS = [[5, 17, 3], [9, 1, 2, 33, 60, 7]]
ALONE = [30, 12, 44, 8]   # refilled into a slot on its own


def _models():
    target = tiny_target(seed=3)
    return target, init_drafter(target, num_layers=1, block_size=H + 1, mask_token_id=V - 1,
                                key=1)


@pytest.fixture(scope="module")
def models():
    return _models()


@pytest.fixture(scope="module")
def reference(models):
    """Cache-free greedy tokens of PROMPTS and ALONE (M each)."""
    return greedy_reference(models[0], PROMPTS + [ALONE], M)


@pytest.fixture(scope="module")
def e2(models):
    return Engine.create(*models, CONFIG, B)


def _tokens(st) -> list[list[int]]:
    """The generated tokens of every row of a state (-1 padding dropped)."""
    out, num = np.asarray(st.out_BM), np.asarray(st.num_out_B)
    return [out[b, : num[b]].tolist() for b in range(out.shape[0])]


def test_shapes_are_fixed_per_engine_and_other_shapes_are_refused(e2):
    assert (e2.spec.batch_size, e2.spec.prompt_len, e2.config.max_new_tokens) == (B, P, M)
    assert e2.spec.horizon == H and e2.spec.num_slots == 7   # budget 6 + the root
    prompts = e2.prompts(PROMPTS)
    assert prompts.tokens_BT.shape == (B, P) and prompts.tokens_BT.dtype == jnp.int32
    assert np.asarray(prompts.lengths_B).tolist() == [3, 6]
    assert np.asarray(prompts.tokens_BT)[1].tolist() == PROMPTS[1] + [0] * (P - 6)
    assert e2.prompts([[1], [2]]).tokens_BT.shape == (B, P)   # one width for any prompt
    with pytest.raises(ValueError, match=r"prompt 1: the prompt has 17 tokens, more than "
                                         r"the prompt buffer \(16\)"):
        e2.prompts([[1], [2] * (P + 1)])
    for batch in ([PROMPTS[0]], PROMPTS + [ALONE]):
        with pytest.raises(ValueError, match=rf"the engine decodes 2 prompts at a time, got "
                                             rf"{len(batch)}"):
            e2.prompts(batch)
    with pytest.raises(ValueError, match=r"prompt_len 8 differs from DecodeConfig.prompt_len"):
        Engine.create(*_models(), CONFIG, B, prompt_len=8)


def test_generate_gives_the_tokens_of_the_one_call_form_and_the_reference(models, e2,
                                                                           reference):
    key = jax.random.key(0)
    st = e2.generate(e2.prompts(PROMPTS), key)
    assert st.out_BM.shape == (B, M)
    gen = e2.finish(st)
    one_call = engine.generate(*models, PROMPTS, CONFIG, key)
    assert gen.tokens.tolist() == one_call.tokens.tolist() == reference[:B]
    assert gen.stats.rounds == one_call.stats.rounds
    assert one_call.tokens.shape == (B, M)


def test_prefill_round_and_run_give_the_generated_tokens(e2, reference):
    st = e2.prefill(e2.prompts(PROMPTS), jax.random.key(0))
    assert int(st.round) == 0 and _tokens(st) == [r[:1] for r in reference[:B]]
    st = e2.round(st)
    assert int(st.round) == 1
    assert all(r[: len(t)] == t and len(t) >= 2 for t, r in zip(_tokens(st), reference))
    gen = e2.finish(e2.run(st))
    assert gen.tokens.tolist() == reference[:B]


def test_a_refill_into_an_empty_slot_decodes_that_prompt_as_alone(models, e2, reference):
    axes = e2.slot_axes()
    empty = e2.empty_slots(jax.random.key(1))
    assert len(axes) == len(jax.tree.leaves(empty))
    assert np.asarray(empty.done_B).all() and not np.asarray(empty.num_out_B).any()
    tokens_KT = np.zeros((1, 8), np.int32)
    tokens_KT[0, : len(ALONE)] = ALONE
    st = e2.refill(empty, tokens_KT, np.array([len(ALONE)], np.int32), np.array([1], np.int32),
                   jax.random.split(jax.random.key(2), 1), axes=axes)
    assert np.asarray(st.done_B).tolist() == [True, False]
    st = e2.run_rounds(st, until_done=B, max_rounds=1)          # exactly one round
    assert int(st.round) == 1 and not bool(st.done_B[1])
    compiled = programs.run_rounds_jit._cache_size()
    st = e2.run_rounds(st, until_done=B, max_rounds=M)          # other bounds, same program
    assert programs.run_rounds_jit._cache_size() == compiled
    assert np.asarray(st.done_B).all()
    # rows of a batch are independent: ALONE's row of a generation (B rows: the same
    # program as e2's) is the prompt decoded alone
    alone = engine.generate(*models, [ALONE, PROMPTS[0]], CONFIG)
    assert _tokens(st) == [[], reference[B]] == [[], alone.tokens[0].tolist()]
    assert int(st.rounds_B[1]) == int(alone.stats.rounds_per_row[0])


def test_rows_move_between_slot_counts_without_changing_their_tokens(models, e2, reference):
    """Two rows decode two rounds on 2 slots, two more on 4 (put into slots 3 and 1 of an
    empty state), then end on 2 again (taken back in the other order)."""
    e4 = Engine.create(*models, CONFIG, 4)
    small = e2.run_rounds(e2.prefill(e2.prompts(PROMPTS), jax.random.key(0)), B, 2)
    assert not np.asarray(small.done_B).any()
    big = e4.put_slots(e4.empty_slots(jax.random.key(1)), small, [3, 1], axes=e4.slot_axes())
    assert np.asarray(big.done_B).tolist() == [True, False, True, False]
    big = e4.run_rounds(big, 4, 2)
    moved = _tokens(big)
    assert moved[0] == moved[2] == [] and not np.asarray(big.done_B)[[1, 3]].any()
    assert reference[1][: len(moved[1])] == moved[1] and reference[0][: len(moved[3])] == moved[3]
    with pytest.raises(ValueError, match=r"take_slots needs 2 row indices, got shape \(3,\)"):
        e2.take_slots(big, [1, 3, 0], axes=e2.slot_axes())
    with pytest.raises(ValueError, match=r"put_slots needs one slot per row \(2\), got shape "
                                         r"\(1,\)"):
        e4.put_slots(e4.empty_slots(jax.random.key(1)), small, [0], axes=e4.slot_axes())
    back = e2.take_slots(big, [1, 3], axes=e2.slot_axes())
    back = e2.run_rounds(back, B, M)
    assert np.asarray(back.done_B).all()
    assert _tokens(back) == [reference[1], reference[0]]


def test_lower_needs_no_weights_and_compiles_the_engines_program(e2, reference):
    abstract = Engine.create(*nnx.eval_shape(_models), CONFIG, B)
    assert abstract.spec == e2.spec
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract.params))
    lowered = abstract.lower("prefill")
    assert isinstance(lowered, jax.stages.Lowered)
    compiled = lowered.compile()
    assert compiled.memory_analysis() is not None
    prompts, key = e2.prompts(PROMPTS), jax.random.key(0)
    got = compiled(e2.params, prompts.tokens_BT, prompts.lengths_B, key)
    want = e2.prefill(prompts, key)
    assert _tokens(got) == [r[:1] for r in reference[:B]]
    for a, b in zip(jax.tree.leaves(dataclasses.replace(got, key_B=None)),
                    jax.tree.leaves(dataclasses.replace(want, key_B=None))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    whole = e2.lower()                                  # the default: 'generate'
    assert whole.out_info.out_BM.shape == (B, M)
    with pytest.raises(ValueError, match="program must be one of"):
        e2.lower("decode")
