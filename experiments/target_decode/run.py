"""Greedy decoding speed of the Flax target vs transformers, and the tree-verify cost.

One random Qwen3-style model (~35 M parameters) is built in transformers, saved with
``save_pretrained`` and loaded with `tev_jax.models.load_target`, so both sides run the
same weights. Measured, interleaved, on CPU, batch 1:

  (a) greedy autoregressive generation, prompt 128, 256 new tokens:
      - transformers ``generate`` (PyTorch, ``do_sample=False``), with 1 and with 2
        torch threads (on a loaded machine 2 threads can be far slower than 1; the
        speedups are reported against the faster of the two);
      - Flax, the whole generation as one jitted ``lax.while_loop`` (prefill + decode);
      - Flax, a jitted per-step decode called from Python;
  (b) one tree verify pass (``Target.verify_tree``) at N in {17, 33, 65, 129} nodes after
      a 128-token prefix, relative to one decode step at the same cache length.

The Flax model is used functionally: ``nnx.split`` once, ``jax.jit`` of a function of
``(graphdef, state, ...)`` that calls ``nnx.merge`` inside.

    python experiments/target_decode/run.py           # full run, writes results.json
    python experiments/target_decode/run.py --quick   # small model, short run
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tev_jax.runtime.platforms import quiet_start

if __name__ == "__main__":
    quiet_start()  # before jax is imported: no libtpu or CUDA plugin lines on a CPU

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tev_jax.models import load_target  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 32000
    hidden: int = 512
    intermediate: int = 1536
    layers: int = 6
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 64
    prompt: int = 128
    new_tokens: int = 256
    tree_sizes: tuple[int, ...] = (17, 33, 65, 129)
    repeats: int = 3
    step_repeats: int = 30
    torch_threads: tuple[int, ...] = (1, 2)
    seed: int = 0
    out: str = str(Path(__file__).with_name("results.json"))


QUICK = dict(vocab=4096, hidden=128, intermediate=384, layers=2, heads=4, kv_heads=2,
             head_dim=32, prompt=32, new_tokens=32, repeats=2, step_repeats=10,
             out=str(Path(__file__).with_name("results_quick.json")))


def build_hf(cfg: Config, path: Path):
    import torch
    import transformers

    torch.manual_seed(cfg.seed)
    hf_cfg = transformers.Qwen3Config(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim, tie_word_embeddings=True,
        max_position_embeddings=4096, initializer_range=0.05,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)
    model = transformers.Qwen3ForCausalLM(hf_cfg).eval()
    model.save_pretrained(path)
    return model


def hf_generate(model, prompt: np.ndarray, n: int) -> tuple[np.ndarray, float]:
    import torch

    ids = torch.tensor(prompt[None])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    dt = time.perf_counter() - t0
    return out[0, prompt.shape[0]:].numpy(), dt


@functools.partial(jax.jit, static_argnames=("graphdef", "n", "max_len"))
def flax_generate(graphdef, state, prompt_BT, *, n: int, max_len: int):
    """Prefill + n-1 greedy decode steps in one lax.while_loop; returns [B, n] tokens."""
    model = nnx.merge(graphdef, state)
    b, t = prompt_BT.shape
    cache = model.init_cache(b, max_len)
    lengths = jnp.full((b,), t, jnp.int32)
    logits, _, cache = model.prefill(cache, prompt_BT, lengths)
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    out = jnp.zeros((b, n), jnp.int32).at[:, 0].set(first)

    def body(carry):
        i, tok, cache, out = carry
        logits, _, cache = model.decode(cache, tok, jnp.full((b,), t - 1, jnp.int32) + i)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        return i + 1, tok, cache, out.at[:, i].set(tok)

    _, _, _, out = jax.lax.while_loop(lambda c: c[0] < n, body, (1, first, cache, out))
    return out


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def flax_prefill(graphdef, state, cache, prompt_BT):
    model = nnx.merge(graphdef, state)
    lengths = jnp.full((prompt_BT.shape[0],), prompt_BT.shape[1], jnp.int32)
    logits, _, cache = model.prefill(cache, prompt_BT, lengths)
    return jnp.argmax(logits, -1).astype(jnp.int32), cache


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def flax_step(graphdef, state, cache, tok_B, start_B):
    logits, _, cache = nnx.merge(graphdef, state).decode(cache, tok_B, start_B)
    return jnp.argmax(logits, -1).astype(jnp.int32), cache


@functools.partial(jax.jit, static_argnames=("graphdef",))
def flax_verify(graphdef, state, cache, tokens_BN, depths_BN, anc_BNN, start_B):
    logits, _, _ = nnx.merge(graphdef, state).verify_tree(cache, tokens_BN, depths_BN,
                                                         anc_BNN, start_B)
    return logits


def flax_stepwise(graphdef, state, prompt, n, max_len):
    cache = nnx.merge(graphdef, state).init_cache(1, max_len)
    t0 = time.perf_counter()
    tok, cache = flax_prefill(graphdef, state, cache, prompt)
    toks = [tok]
    for i in range(1, n):
        tok, cache = flax_step(graphdef, state, cache, tok,
                               jnp.array([prompt.shape[1] - 1 + i], jnp.int32))
        toks.append(tok)
    out = np.asarray(jnp.stack(toks, 1))
    return out, time.perf_counter() - t0


def random_tree(rng, n):
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
    depths = np.zeros(n, np.int32)
    anc = np.eye(n, dtype=bool)
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
        anc[i] = anc[parents[i]]
        anc[i, i] = True
    return depths, anc


def time_calls(fn, repeats):
    """Fastest of ``repeats`` timed calls (robust to a noisy, shared machine)."""
    jax.block_until_ready(fn())  # warm
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return min(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    cfg = Config(**QUICK) if args.quick else Config()
    import torch

    rng = np.random.default_rng(cfg.seed)
    tmp = Path(tempfile.mkdtemp())
    hf = build_hf(cfg, tmp / "m")
    model = load_target(tmp / "m")
    n_params = sum(p.numel() for p in hf.parameters())
    graphdef, state = nnx.split(model)
    prompt = rng.integers(0, cfg.vocab, cfg.prompt).astype(np.int32)
    max_len = cfg.prompt + cfg.new_tokens + max(cfg.tree_sizes)
    print(f"params {n_params / 1e6:.1f} M, torch threads {torch.get_num_threads()}, "
          f"jax {jax.__version__}, devices {jax.devices()}", flush=True)

    # compile
    t0 = time.perf_counter()
    jax.block_until_ready(flax_generate(graphdef, state, jnp.asarray(prompt[None]),
                                        n=cfg.new_tokens, max_len=max_len))
    compile_s = time.perf_counter() - t0
    flax_stepwise(graphdef, state, jnp.asarray(prompt[None]), 3, max_len)
    hf_generate(hf, prompt, 4)

    hf_t = {th: [] for th in cfg.torch_threads}
    loop_t, step_t = [], []
    for r in range(cfg.repeats):  # interleaved
        for th in cfg.torch_threads:
            torch.set_num_threads(th)
            hf_tok, dt = hf_generate(hf, prompt, cfg.new_tokens)
            hf_t[th].append(dt)
        t0 = time.perf_counter()
        loop_tok = np.asarray(flax_generate(graphdef, state, jnp.asarray(prompt[None]),
                                            n=cfg.new_tokens, max_len=max_len))[0]
        loop_t.append(time.perf_counter() - t0)
        step_tok, dt = flax_stepwise(graphdef, state, jnp.asarray(prompt[None]),
                                     cfg.new_tokens, max_len)
        step_t.append(dt)
        hf_msg = "  ".join(f"transformers/{th}thr {hf_t[th][-1]:.2f}s" for th in hf_t)
        print(f"repeat {r}: {hf_msg}  flax while_loop {loop_t[-1]:.2f}s  "
              f"flax per-step {step_t[-1]:.2f}s", flush=True)
    agree = int(np.sum(np.cumprod(hf_tok == loop_tok)))
    same_stepwise = bool(np.array_equal(loop_tok, step_tok[0]))

    # (b) verify pass vs one decode step, cache holding the prompt
    cache = nnx.merge(graphdef, state).init_cache(1, max_len)
    tok, cache = flax_prefill(graphdef, state, cache, jnp.asarray(prompt[None]))
    start = jnp.array([cfg.prompt], jnp.int32)
    step_cache = cache

    def one_step():  # a decode step = the same extend with one token (N = 1)
        return flax_verify(graphdef, state, step_cache, tok[:, None], jnp.zeros((1, 1), jnp.int32),
                           jnp.ones((1, 1, 1), bool), start)

    decode_s = time_calls(one_step, cfg.step_repeats)
    verify = {}
    for n in cfg.tree_sizes:
        depths, anc = random_tree(rng, n)
        toks = jnp.asarray(rng.integers(0, cfg.vocab, (1, n)).astype(np.int32))
        f = functools.partial(flax_verify, graphdef, state, cache, toks,
                              jnp.asarray(depths[None]), jnp.asarray(anc[None]), start)
        verify[n] = time_calls(f, cfg.step_repeats)
        print(f"verify N={n}: {verify[n] * 1e3:.2f} ms = {verify[n] / decode_s:.2f} x decode "
              f"step ({decode_s * 1e3:.2f} ms)", flush=True)

    med = statistics.median
    hf_best = min(med(v) for v in hf_t.values())
    res = {
        "config": dataclasses.asdict(cfg),
        "params_M": round(n_params / 1e6, 2),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "jax": jax.__version__, "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads()},
        "ar": {
            "transformers_s": {f"{th}_threads": v for th, v in hf_t.items()},
            "flax_while_loop_s": loop_t, "flax_per_step_s": step_t,
            "tokens_per_s": {
                **{f"transformers_{th}_threads": cfg.new_tokens / med(v)
                   for th, v in hf_t.items()},
                "flax_while_loop": cfg.new_tokens / med(loop_t),
                "flax_per_step": cfg.new_tokens / med(step_t),
            },
            "speedup_vs_best_transformers": {
                "flax_while_loop": hf_best / med(loop_t),
                "flax_per_step": hf_best / med(step_t),
            },
            "flax_compile_s": compile_s,
            "greedy_tokens_agreeing_prefix": agree,
            "while_loop_equals_per_step": same_stepwise,
        },
        "verify": {
            "decode_step_ms": decode_s * 1e3,
            "verify_ms": {str(n): t * 1e3 for n, t in verify.items()},
            "verify_over_decode": {str(n): t / decode_s for n, t in verify.items()},
        },
    }
    print(json.dumps(res["ar"]["tokens_per_s"], indent=1))
    print(json.dumps(res["ar"]["speedup_vs_best_transformers"], indent=1))
    print(f"greedy agreement: first {agree}/{cfg.new_tokens} tokens identical")
    Path(cfg.out).write_text(json.dumps(res, indent=2))
    print("wrote", cfg.out)


if __name__ == "__main__":
    main()
