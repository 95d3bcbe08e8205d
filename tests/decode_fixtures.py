"""Tiny targets and drafters shared by the decode-engine tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tev_jax import drafters
from tev_jax.models import ModelConfig, init_target, score


def tiny_target(vocab=64, hidden=32, layers=2, seed=0, head_scale=20.0, experts=0):
    """A random Qwen3 target; lm_head scaled so logits are O(1) (no near-ties).

    ``experts`` > 0: a Qwen3-MoE target with that many experts (top-2, renormalised)
    in every layer, routers scaled up so routing is not decided by near-ties.
    """
    moe = {} if not experts else dict(num_experts=experts, num_experts_per_tok=2,
                                      moe_intermediate_size=hidden, norm_topk_prob=True)
    cfg = ModelConfig(model_type="qwen3_moe" if experts else "qwen3", vocab_size=vocab,
                      hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                      num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, **moe)
    target = init_target(cfg, key=seed)
    target.lm_head[...] = target.lm_head[...] * head_scale
    if experts:
        router = target.layers.mlp.gate.kernel
        router[...] = router[...] * 50.0
    return target


class MixDrafter(nnx.Module):
    """The DFlash drafter (random weights) or the oracle, chosen by a runtime flag."""

    def __init__(self, dflash, oracle):
        self.dflash = drafters.DFlashDrafter(dflash)
        self.oracle = oracle
        self.use_oracle = nnx.Variable(jnp.asarray(False))
        self.block_size = self.dflash.block_size
        self.target_layer_ids = self.dflash.target_layer_ids

    def init_context(self, target, batch, max_len):
        return (self.dflash.init_context(target, batch, max_len),
                self.oracle.init_context(target, batch, max_len))

    def extend_context(self, target, ctx, tokens_BP, feats_BPF, start_B, count_B):
        return (self.dflash.extend_context(target, ctx[0], tokens_BP, feats_BPF, start_B, count_B),
                self.oracle.extend_context(target, ctx[1], tokens_BP, feats_BPF, start_B, count_B))

    def draft(self, target, ctx, root_B, start_B):
        rand, c0 = self.dflash.draft(target, ctx[0], root_B, start_B)
        good, c1 = self.oracle.draft(target, ctx[1], root_B, start_B)
        return jnp.where(self.use_oracle[...], good, rand), (c0, c1)


def greedy_reference(target, prompts, n):
    """Cache-free greedy continuation of every prompt (one full forward per token)."""
    graphdef, state = nnx.split(target)
    width = max(map(len, prompts)) + n
    width = -(-width // 64) * 64

    @jax.jit
    def next_tokens(state, buf_BL, last_B):
        logits_BLV = score(nnx.merge(graphdef, state), buf_BL)
        return jnp.argmax(logits_BLV[jnp.arange(buf_BL.shape[0]), last_B], axis=-1)

    buf = np.zeros((len(prompts), width), np.int32)
    lens = np.array([len(p) for p in prompts])
    for i, p in enumerate(prompts):
        buf[i, : len(p)] = p
    rows = np.arange(len(prompts))
    for _ in range(n):
        nxt = np.asarray(next_tokens(state, jnp.asarray(buf), jnp.asarray(lens - 1)))
        buf[rows, lens] = nxt
        lens = lens + 1
    return [buf[i, len(p): len(p) + n].tolist() for i, p in enumerate(prompts)]


class TableDrafter(nnx.Module):
    """A context-free drafter: the rows of root r are ``table[r]`` ([V, H, V] logits)."""

    def __init__(self, table_VHV):
        self.table = nnx.Param(jnp.asarray(table_VHV, jnp.float32))
        self.block_size = int(table_VHV.shape[1]) + 1
        self.target_layer_ids = ()

    def init_context(self, target, batch, max_len):
        return ()

    def extend_context(self, target, ctx, tokens_BP, feats_BPF, start_B, count_B):
        return ctx

    def draft(self, target, ctx, root_B, start_B):
        return self.table[...][root_B], ctx


def jit_score(target):
    """``tokens [B, L] -> float32 logits [B, L, V]``, jitted (eager forwards are slow)."""
    graphdef, state = nnx.split(target)
    fn = jax.jit(lambda state, tokens: score(nnx.merge(graphdef, state), tokens))
    return lambda tokens: np.asarray(fn(state, jnp.asarray(tokens, jnp.int32)))


def oracle_table(target, prompt, horizon):
    """[V, H, V]: for every root r, the target's logits along its greedy chain after
    ``prompt + [r]`` (what the oracle drafter proposes in the first round)."""
    vocab = target.config.vocab_size
    run = jit_score(target)
    p = len(prompt)
    # One fixed width: causal logits at a position do not depend on what follows it.
    seqs = np.zeros((vocab, p + horizon), np.int32)
    seqs[:, :p] = prompt
    seqs[:, p] = np.arange(vocab)
    rows = []
    for d in range(horizon):
        logits = run(seqs)[:, p + d]
        rows.append(logits)
        if p + d + 1 < seqs.shape[1]:
            seqs[:, p + d + 1] = logits.argmax(-1)
    return np.stack(rows, axis=1)
