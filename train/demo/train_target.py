"""Pre-trains the bundled demo target (a small Qwen3) on the offline corpus.

Resumable: a run writes orbax checkpoints to ``--out/checkpoints`` every
``--checkpoint-minutes`` and restarts from the newest one; batch k is a pure function of
(seed, k), so a resumed run sees exactly the batches it would have seen. At the end (or
with ``--export-only``) the model is written as a Hugging Face directory with the
tokenizer::

    python -m train.demo.prepare_corpus --update-bundled        # once: runs/corpus
    python -m train.demo.train_target --out runs/target --steps 1700
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

from tev_jax import data
from tev_jax.models import ModelConfig, Target, save_target
from train.demo import token_corpus
from train.optimizer import OptimConfig, make_optimizer


@dataclasses.dataclass(frozen=True)
class TargetTrainConfig:
    """Pre-training hyper-parameters of the demo target."""

    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 1700
    peak_lr: float = 2e-3
    warmup_steps: int = 300
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    mixture_alpha: float = 0.5
    seed: int = 0

    def model_config(self, vocab_size: int) -> ModelConfig:
        return ModelConfig(
            model_type="qwen3", vocab_size=vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=self.num_layers,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, rope_theta=10000.0, rope_scaling=None,
            rms_norm_eps=1e-6, tie_word_embeddings=True, qk_norm=True,
            attention_bias=False, max_position_embeddings=2048,
        )


def optim_config(cfg: TargetTrainConfig) -> OptimConfig:
    """The target's AdamW: warmup over at most a tenth of the run, cosine decay to 5 % of
    the peak, every parameter decayed (norm scales included)."""
    return OptimConfig(lr=cfg.peak_lr, steps=cfg.steps,
                       warmup_steps=min(cfg.warmup_steps, cfg.steps // 10),
                       end_lr_ratio=0.05, weight_decay=cfg.weight_decay,
                       decay_vectors=True, grad_clip=cfg.clip_norm)


def lm_loss(graphdef, params, tokens_BL):
    """Mean next-token cross-entropy of ``tokens[:, 1:]`` given ``tokens[:, :-1]``."""
    model = nnx.merge(graphdef, params)
    logits, _ = model(tokens_BL[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens_BL[:, 1:]).mean()


def make_train_step(graphdef, tx):
    @jax.jit
    def train_step(params, opt_state, tokens_BL):
        loss, grads = jax.value_and_grad(lambda p: lm_loss(graphdef, p, tokens_BL))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def evaluate(graphdef, params, corpus, seq_len, max_windows=16) -> dict[str, float]:
    """Held-out next-token loss (nats/token) per domain."""
    loss_fn = jax.jit(lambda p, w: lm_loss(graphdef, p, w))
    out = {}
    for domain, stream in sorted(corpus.val.items()):
        windows = token_corpus.validation_windows(stream, seq_len + 1, max_windows)
        out[domain] = float(np.mean([loss_fn(params, windows[i:i + 8])
                                     for i in range(0, len(windows), 8)]))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default="runs/corpus")
    p.add_argument("--out", default="runs/target")
    p.add_argument("--steps", type=int, default=TargetTrainConfig.steps)
    p.add_argument("--batch-size", type=int, default=TargetTrainConfig.batch_size)
    p.add_argument("--seq-len", type=int, default=TargetTrainConfig.seq_len)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-minutes", type=float, default=5.0)
    p.add_argument("--eval-every", type=int, default=2000)
    p.add_argument("--stop-after-minutes", type=float, default=None,
                   help="checkpoint and exit after this long (resume later)")
    p.add_argument("--export-only", action="store_true")
    args = p.parse_args(argv)

    cfg = TargetTrainConfig(steps=args.steps, batch_size=args.batch_size,
                            seq_len=args.seq_len, seed=args.seed)
    tokenizer = data.load_default_tokenizer()
    corpus = token_corpus.load_token_corpus(args.corpus, tokenizer)
    windows = token_corpus.WindowConfig(
        cfg.batch_size, cfg.seq_len + 1, cfg.seed,
        token_corpus.mixture_weights(corpus.train, cfg.mixture_alpha))
    model = Target(cfg.model_config(tokenizer.get_vocab_size()),
                   rngs=nnx.Rngs(params=jax.random.key(cfg.seed)))
    graphdef, params = nnx.split(model, nnx.Param)
    tx, _ = make_optimizer(optim_config(cfg))
    opt_state = tx.init(params)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    manager = ocp.CheckpointManager(
        (out / "checkpoints").absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=2))
    step = 0
    if manager.latest_step() is not None:
        step = manager.latest_step()
        restored = manager.restore(step, args=ocp.args.StandardRestore(
            {"params": params, "opt_state": opt_state}))
        params, opt_state = restored["params"], restored["opt_state"]
        print(f"resumed from step {step}")

    train_step = make_train_step(graphdef, tx)
    log = (out / "log.jsonl").open("a")
    started = last_ckpt = time.time()
    bar = tqdm(total=cfg.steps, initial=step, disable=args.export_only)
    while step < cfg.steps and not args.export_only:
        batch = jnp.asarray(token_corpus.train_batch(corpus.train, windows, step))
        t0 = time.time()
        params, opt_state, loss = train_step(params, opt_state, batch)
        loss = float(loss)
        if not np.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step}")
        step += 1
        bar.update(1)
        record = {"step": step, "loss": loss,
                  "tokens_per_s": cfg.batch_size * cfg.seq_len / (time.time() - t0)}
        if step % args.eval_every == 0 or step == cfg.steps:
            record["val"] = evaluate(graphdef, params, corpus, cfg.seq_len)
            bar.write(f"step {step}: val {record['val']}")
        if step % 20 == 0 or "val" in record:
            log.write(json.dumps(record) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{loss:.3f}")
        now = time.time()
        out_of_time = (args.stop_after_minutes is not None
                       and now - started > 60 * args.stop_after_minutes)
        if now - last_ckpt > 60 * args.checkpoint_minutes or step == cfg.steps or out_of_time:
            manager.save(step, args=ocp.args.StandardSave(
                {"params": params, "opt_state": opt_state}))
            last_ckpt = now
        if out_of_time:
            break
    manager.wait_until_finished()
    bar.close()
    if step >= cfg.steps or args.export_only:
        save_target(nnx.merge(graphdef, params), out / "hf", tokenizer=tokenizer)
        print(f"exported the target to {out / 'hf'}")


if __name__ == "__main__":
    main()
