"""The optimiser of every training run here: AdamW, warmup + cosine, global-norm clipping.

One builder for the drafter's step (`train.step`) and the demo target's pre-training
(`train.demo.train_target`); an `OptimConfig` (frozen, hashable) says everything about it,
including the micro-batches per update (``grad_accum``, ``optax.MultiSteps``).
"""

from __future__ import annotations

import dataclasses

import jax
import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup + cosine decay and global-norm clipping (hashable).

    Attributes:
      lr: peak learning rate.
      steps: optimiser updates of the run (the cosine's length).
      warmup_steps: linear warmup from 0 (0: start at ``lr``).
      end_lr_ratio: the cosine ends at ``lr * end_lr_ratio``.
      weight_decay: AdamW decay of matrices.
      decay_vectors: also decay vectors (norm scales, biases); by default they are not.
      b1, b2, eps: Adam moments and denominator epsilon.
      grad_clip: global-norm clipping threshold.
      grad_accum: micro-batches per update (``optax.MultiSteps``).
    """

    lr: float
    steps: int
    warmup_steps: int = 0
    end_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    decay_vectors: bool = False
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    grad_accum: int = 1


def make_optimizer(ocfg: OptimConfig):
    """The optax transform of an `OptimConfig` and its learning rate per micro-batch.

    Returns:
      (optax.GradientTransformation, lr_schedule: micro-batch index (``step`` of a
       `train.state.TrainState`) -> learning rate of the update it belongs to)
    """
    c = ocfg
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0 if c.warmup_steps else c.lr, peak_value=c.lr,
        warmup_steps=c.warmup_steps, decay_steps=max(c.steps, c.warmup_steps + 1),
        end_value=c.lr * c.end_lr_ratio)
    decay_mask = None if c.decay_vectors else (
        lambda params: jax.tree.map(lambda p: p.ndim > 1, params))
    tx = optax.chain(optax.clip_by_global_norm(c.grad_clip),
                     optax.adamw(schedule, b1=c.b1, b2=c.b2, eps=c.eps,
                                 weight_decay=c.weight_decay, mask=decay_mask))
    if c.grad_accum > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=c.grad_accum)
    return tx, lambda step: schedule(step // c.grad_accum)


__all__ = ["OptimConfig", "make_optimizer"]
