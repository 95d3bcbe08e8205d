"""Blocked attention == the dense reference (values and gradients), chunked prefill."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reference_attention import attend_segments, dense_mask
from tev_jax.models import ModelConfig, init_target
from tev_jax.models.attention import Mask, attention
from tev_jax.kernels import cache_attention
from tev_jax.kernels.cache_attention import merge_states
from tev_jax.kernels.cache_attention import tpu_fits as cache_fits


def _normal(key, shape, dtype=jnp.float32):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _ancestors(rng, b, n):
    """Random tree ancestor masks [B, N, N] (self included); node 0 is the root."""
    out = np.zeros((b, n, n), bool)
    for r in range(b):
        parent = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
        for i in range(n):
            j = i
            while j >= 0:
                out[r, i, j] = True
                j = parent[j]
    return out


def _case(name, rng):
    """(T, [(S_i, mask_i)], H, K) of one mask rule; lengths drawn with rng."""
    b = 3
    if name == "cache+causal":          # target prefill / extend: [cache ; new tokens]
        t, s = 23, 41
        return b, t, 4, 2, [(s, Mask.prefix(jnp.array([0, 17, 0]))),
                            (t, Mask.causal(t, jnp.array([t, 9, 0])))]
    if name == "cache+tree":            # tree verify: cache prefix + ancestor mask
        n, s = 13, 37
        return b, n, 6, 2, [(s, Mask.prefix(jnp.array(rng.integers(1, s, b)))),
                            (n, jnp.asarray(_ancestors(rng, b, n)))]
    if name == "context+blocks":        # DFlash training: context < anchor, own block
        a, q, s = 4, 5, 29
        anchors = jnp.array(rng.integers(0, s, (b, a)))
        return b, a * q, 4, 1, [(s, Mask(end=jnp.repeat(anchors, q, axis=1))),
                                (a * q, Mask.blocks(a * q, q))]
    if name == "context+all":           # DFlash drafting: cached context + whole block
        q, s = 6, 33
        return b, q, 8, 2, [(s, Mask.prefix(jnp.array([5, 0, 33]))), (q, Mask())]
    if name == "range+dense":           # every field at once, fully masked rows included
        t, s = 11, 19
        start = jnp.array(rng.integers(0, s, (b, t)))
        dense = jnp.asarray(rng.random((b, t, s)) < 0.7)
        return b, t, 2, 2, [(s, Mask(start=start, end=start + 6, dense=dense))]
    raise ValueError(name)


CASES = ["cache+causal", "cache+tree", "context+blocks", "context+all", "range+dense"]


def _inputs(name, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    b, t, h, kh, segs = _case(name, rng)
    keys = iter(jax.random.split(jax.random.key(seed), 2 + 2 * len(segs)))
    hd = 8
    q = _normal(next(keys), (b, t, h, hd), dtype)
    kvs = [(_normal(next(keys), (b, s, kh, hd), dtype), _normal(next(keys), (b, s, kh, hd), dtype))
           for s, _ in segs]
    masks = [m for _, m in segs]
    w = _normal(next(keys), (b, t, h, hd))   # cotangent: loss = sum(out * w)
    return q, kvs, masks, w


def _out_and_grads(fn, q, kvs, masks, w):
    """Jitted (fn's output, gradients of sum(out * w) wrt q and every k, v)."""
    def run(q, kvs, w):
        call = lambda q, kvs: fn(q, tuple((k, v, m) for (k, v), m in zip(kvs, masks)))
        out, vjp = jax.vjp(call, q, kvs)
        return out, vjp(w.astype(out.dtype))
    return jax.jit(run)(q, kvs, w)


def _assert_close(got, want, tol):
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                   atol=tol, rtol=tol)


@pytest.mark.parametrize("name,key_block,query_block", [
    *[(name, 7, 5) for name in CASES],     # blocks that divide neither T nor S
    ("cache+causal", 512, 512), ("cache+tree", 512, 512),   # one block per segment
])
def test_blocked_equals_dense_values_and_gradients(name, key_block, query_block):
    """Every mask rule: same outputs and gradients (q, each k and v) as dense."""
    q, kvs, masks, w = _inputs(name)
    blocked = functools.partial(attention, key_block=key_block, query_block=query_block)
    _assert_close(_out_and_grads(blocked, q, kvs, masks, w),
                  _out_and_grads(attend_segments, q, kvs, masks, w), 1e-5)


def test_fully_masked_rows_are_zero_with_finite_gradients():
    q, kvs, masks, w = _inputs("cache+causal")
    seen = np.zeros((3, 23), bool)
    for seg_mask, (k, _) in zip(masks, kvs):
        seen |= dense_mask(seg_mask, 3, 23, k.shape[1]).any(-1)
    assert (~seen).any() and seen.any()   # the case has both kinds of rows
    fn = functools.partial(attention, key_block=8, query_block=4)
    out, (dq, dkvs) = _out_and_grads(fn, q, kvs, masks, w)
    out = np.asarray(out)
    np.testing.assert_array_equal(out[~seen], 0.0)
    assert np.abs(out[seen]).sum(-1).min() > 0
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(dkvs))
    np.testing.assert_array_equal(np.asarray(dq)[~seen], 0.0)
    assert np.isfinite(np.asarray(dq)).all()


@pytest.mark.parametrize("name", ["cache+causal", "cache+tree"])
def test_bfloat16_inputs(name):
    """bfloat16 q/k/v: float32 scores and accumulation, close to the float32 result."""
    q, kvs, masks, w = _inputs(name, jnp.bfloat16)
    fn = functools.partial(attention, key_block=8, query_block=8)
    got = _out_and_grads(fn, q, kvs, masks, w)
    assert got[0].dtype == jnp.bfloat16
    f32 = lambda x: x.astype(jnp.float32)
    _assert_close(got, _out_and_grads(attend_segments, f32(q), jax.tree.map(f32, kvs),
                                      masks, w), 5e-2)


def test_stacked_layer_reads_like_its_slice():
    """``(k, v, mask, layer)`` on stacked [layers, B, S, K, hd] == ``(k[layer], v[layer], mask)``,
    values and gradients (the cotangent of the other layers is zero)."""
    q, ((kc, vc), (kn, vn)), masks, w = _inputs("cache+causal")
    kst, vst = jnp.stack([kc * 0.5, kc, kc * 2]), jnp.stack([vc + 1, vc, vc - 1])
    fn = functools.partial(attention, key_block=8, query_block=8)

    def stacked(q, kst, vst, layer):
        return fn(q, ((kst, vst, masks[0], layer), (kn, vn, masks[1])))

    w_ = w.astype(jnp.float32)
    got, grads = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(stacked(*a) * w_),
                                            argnums=(0, 1, 2)))(q, kst, vst, 1)
    want, ref = jax.value_and_grad(
        lambda q, k, v: jnp.sum(attend_segments(q, ((k, v, masks[0]), (kn, vn, masks[1])))
                                * w_), argnums=(0, 1, 2))(q, kc, vc)
    _assert_close((got, grads[0], grads[1][1], grads[2][1]), (want,) + ref, 1e-4)
    for g in grads[1:]:
        np.testing.assert_array_equal(np.asarray(g)[[0, 2]], 0.0)


@pytest.mark.parametrize("platform", ["tpu", "cuda", "reference"])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_cache_kernel_state_joins_into_the_joint_softmax(kv_heads, platform):
    """The TPU and the GPU kernel over a stacked cache (interpreted), and their plain-jnp
    reference: the state over
    layer 1 seen up to each row's end (a row that sees nothing, one ending inside a key
    block, one seeing all 44 keys, in blocks of 16: the last runs past the cache), joined
    with the state over a second segment (`merge_states`) and normalised, is attention
    over both segments (the dense reference). The GPU kernel pads the 20 query rows to a
    tile of 32 and splits the key blocks over programs."""
    rng = np.random.default_rng(3)
    b, t, h, hd, s, n = 3, 5, 4, 16, 44, 7
    f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    q = f32(b, t, h, hd)
    k, v = f32(3, b, s, kv_heads, hd), f32(3, b, s, kv_heads, hd)
    kn, vn = f32(b, n, kv_heads, hd), f32(b, n, kv_heads, hd)
    end = jnp.asarray([0, 21, 44], jnp.int32)
    g = h // kv_heads
    q_grouped = q.reshape(b, t, kv_heads, g, hd).transpose(0, 2, 1, 3, 4).reshape(
        b, kv_heads, t * g, hd)
    state = lambda *a: cache_attention.cache_attention_state(
        q_grouped, *a, scale=hd ** -0.5, platform=platform, key_block=16, interpret=True)
    cache = state(k, v, jnp.int32(1), end)
    m, l, o = merge_states(cache, state(kn[None], vn[None], jnp.int32(0),
                                        jnp.full((b,), n, jnp.int32)))
    got = (o / l[..., None]).reshape(b, kv_heads, t, g, hd).transpose(0, 2, 1, 3, 4)
    want = attend_segments(q, ((k[1], v[1], Mask.prefix(end)), (kn, vn, Mask())))
    np.testing.assert_allclose(np.asarray(got.reshape(b, t, h, hd)), np.asarray(want),
                               atol=1e-5)
    assert np.isneginf(np.asarray(cache[0][0])).all() and not np.asarray(cache[1][0]).any()


def test_gpu_cache_kernel_splits_the_key_blocks_over_programs():
    """A long cache and few query rows (an AR step): the GPU kernel (interpreted) splits
    the 32 key blocks over programs and joins their states; the result is the TPU
    kernel's state (a row that sees nothing, one ending inside a block, one seeing all)."""
    rng = np.random.default_rng(5)
    b, kh, qg, hd, s = 3, 1, 4, 16, 2048
    f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    q, k, v = f32(b, kh, qg, hd), f32(2, b, s, kh, hd), f32(2, b, s, kh, hd)
    end = jnp.asarray([0, 1000, s], jnp.int32)
    args = (q, k, v, jnp.int32(1), end)
    got = cache_attention.gpu_state(*args, scale=0.25, interpret=True)
    want = cache_attention.tpu_state(*args, scale=0.25, interpret=True)
    for a, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_cache_kernel_fits_rounds_not_prefill_chunks():
    """Which passes take the TPU cache kernel: a round's 65 queries x 8 query heads per
    key/value head fit its VMEM budget, a 512-token prefill chunk's do not (a scores
    block of 4096 x 512 float32 alone is 8 MiB) and keep the blocked XLA attention."""
    assert cache_fits(65 * 8, 128, 2048) and cache_fits(1, 128, 2048)
    assert not cache_fits(512 * 8, 128, 2048)


def test_refusals():
    q = jnp.zeros((1, 2, 3, 4))
    k = jnp.zeros((1, 5, 2, 4))
    with pytest.raises(ValueError, match="not a multiple of 2 key/value heads"):
        attention(q, ((k, k, Mask()),))
    with pytest.raises(ValueError, match="key_block"):
        attention(q[:, :, :2], ((k, k, Mask()),), key_block=0)
    with pytest.raises(ValueError, match="do not match"):
        attention(q[:, :, :2], ((k, k[:, :, :1], Mask()),))


# ----------------------------------------------------------------- chunked prefill


TINY = ModelConfig(model_type="qwen3", vocab_size=97, hidden_size=32, intermediate_size=64,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)


@pytest.fixture(scope="module")
def tiny():
    return init_target(TINY, key=3)


@pytest.mark.parametrize("chunk", [3, 5, 16])
def test_chunked_prefill_equals_one_pass(tiny, chunk):
    """Logits, taps (every position) and the committed cache do not depend on chunk."""
    b, t, length = 3, 13, 40
    rng = np.random.default_rng(chunk)
    tokens = jnp.asarray(rng.integers(0, TINY.vocab_size, (b, t)), jnp.int32)
    lengths = jnp.array([13, 6, 1], jnp.int32)
    start = jnp.array([0, 4, 9], jnp.int32)
    # A cache that already holds a committed prefix of `start` tokens per row.
    pre = jnp.asarray(rng.integers(0, TINY.vocab_size, (b, 9)), jnp.int32)
    cache = tiny.prefill(tiny.init_cache(b, length), pre, start)[2]

    one = jax.jit(lambda cache: tiny.prefill(cache, tokens, lengths, start, (0, 1)))(cache)
    chunked = jax.jit(lambda cache: tiny.prefill(cache, tokens, lengths, start, (0, 1),
                                                 chunk=chunk))(cache)
    np.testing.assert_allclose(np.asarray(chunked[0]), np.asarray(one[0]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(chunked[1]), np.asarray(one[1]), atol=1e-5)
    for r in range(b):
        n = int(start[r] + lengths[r])
        for got, want in ((chunked[2].k, one[2].k), (chunked[2].v, one[2].v)):
            np.testing.assert_allclose(np.asarray(got[:, r, :n]), np.asarray(want[:, r, :n]),
                                       atol=1e-5)


def test_chunked_prefill_is_one_loop(tiny):
    """The program does not grow with the prompt: a loop over chunks, not unrolled."""
    def size(t):
        tokens = jnp.zeros((2, t), jnp.int32)
        fn = lambda: tiny.prefill(tiny.init_cache(2, 64), tokens, jnp.array([t, 1]), chunk=4)
        return len(jax.make_jaxpr(fn)().eqns)

    assert size(12) == size(48)
    with pytest.raises(ValueError, match="prefill chunk must be a positive int"):
        tiny.prefill(tiny.init_cache(1, 8), jnp.zeros((1, 4), jnp.int32), jnp.array([4]),
                     chunk=0)
