"""Tiny models and a learnable rollout set shared by the training tests."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tev_jax.models import ModelConfig, init_target
from tev_jax.models.drafter_io import init_drafter
from train.config import TrainConfig
from train.rollouts import RolloutSet

TARGET = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)
BLOCK = 4       # H = 3
SEQ_LEN = 24
MASK_ID = 3


@functools.lru_cache(maxsize=None)
def models():
    """(target, drafter): a random 2-layer target and a fresh 1-layer drafter."""
    target = init_target(TARGET, key=0)
    # normal(0.02) heads give logits of std ~0.1; a trained LM's are a few units.
    target.lm_head[...] = target.lm_head[...] * 25.0
    drafter = init_drafter(target, num_layers=1, block_size=BLOCK, mask_token_id=MASK_ID, key=1)
    return target, drafter


@functools.lru_cache(maxsize=None)
def progressions(num: int = 64, seed: int = 0) -> RolloutSet:
    """Arithmetic progressions ``4 + (s + d*i) mod 60``, d in {1, 2, 3}: the next tokens
    follow from the root and the step, which the context reveals (a learnable task)."""
    rng = np.random.default_rng(seed)
    s = rng.integers(0, 60, num)[:, None]
    d = rng.integers(1, 4, num)[:, None]
    tokens = (4 + (s + d * np.arange(SEQ_LEN)[None]) % 60).astype(np.int32)
    prompt = rng.integers(2, 6, num)
    spans = np.stack([prompt, np.full(num, SEQ_LEN)], axis=1)
    return RolloutSet(tokens, spans)


def config(out_dir, **kw) -> TrainConfig:
    base = dict(loss="exit", budget=8, exit_lambda=0.5, batch_size=8, num_anchors=2,
                steps=30, lr=1e-2, warmup_steps=0, b2=0.99, checkpoint_every=3,
                keep_checkpoints=2, out_dir=str(out_dir), seed=0)
    base.update(kw)
    return TrainConfig(**base)


def write_train_dirs(root) -> None:
    """The files a ``tev-train run`` reads, under ``root``: the tiny `models` as
    ``target/`` and ``drafter/`` checkpoints and the `progressions` as ``data/``, rollouts
    of that target (its fingerprint in their info)."""
    from tev_jax.models import save_target
    from tev_jax.models.checkpoint_io import weights_fingerprint
    from tev_jax.models.drafter_io import save_drafter
    from train.rollouts import write_rollouts

    target, drafter = models()
    save_target(target, root / "target")
    save_drafter(drafter, root / "drafter")
    data = progressions()
    write_rollouts(root / "data", [t[:s] for t, (s, _) in zip(data.tokens, data.spans)],
                   [t[s:e] for t, (s, e) in zip(data.tokens, data.spans)],
                   info={"target": str(root / "target"),
                         "target_fingerprint": weights_fingerprint(root / "target")})


@pytest.fixture(scope="module")
def train_dirs(tmp_path_factory):
    """A folder of `write_train_dirs`, per test module."""
    root = tmp_path_factory.mktemp("train")
    write_train_dirs(root)
    return root
