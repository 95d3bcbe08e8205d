"""Temporary memory of the target's prefill and tree-verify programs (attention part).

Compiles, on abstract parameters (no weights are made), the target prefill and the
tree verify pass of a Qwen3-shaped target and prints XLA's temporary (scratch) bytes
per program, so the attention's memory can be compared before / after a change::

    python -m experiments.scale.attention_memory                     # Qwen3-4B, 2 layers
    python -m experiments.scale.attention_memory --chunk 512 --batch 8 --prompt 2944

Measured (2-core CPU, jax 0.10.2; Qwen3-4B widths, 2 layers, B 8, prompt 2944,
cache 4096, float32, temporary bytes per program):

=====================================  ============  ============
program                                prefill       verify N 65
=====================================  ============  ============
dense attention (before, a75d02c^)     52.9 GiB      0.65 GiB
blocked, no chunk                      4.28 GiB      0.084 GiB
blocked, ``--chunk 512``               1.29 GiB      0.084 GiB
``--chunk 512 --batch 16``             2.59 GiB      0.168 GiB
``--chunk 512 --cache 8192``           1.29 GiB      0.084 GiB
``--chunk 512 --prompt 5888 --cache 8192``  1.43 GiB  0.084 GiB
=====================================  ============  ============

Scratch is linear in B and does not grow with the cache length; with a chunk the
prompt adds only its [B, T, F] taps buffer. The cache itself (0.25 GiB here) is an
argument, not scratch.
"""

from __future__ import annotations

import argparse
import inspect
import time

import jax
import jax.numpy as jnp
from flax import nnx

from tev_jax.costs.plan import preset
from tev_jax.models.target import Target

GIB = 2.0 ** 30


def _temp_gib(fn, *args) -> tuple[float, float]:
    """(temporary GiB, compile seconds) of ``jax.jit(fn)`` on abstract arguments, with
    the cache (argument 1) donated as the decode engine does."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn, donate_argnums=1).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes / GIB, time.perf_counter() - t0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-4b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=2944, help="prompt buffer T")
    p.add_argument("--cache", type=int, default=4096, help="cache length L")
    p.add_argument("--nodes", type=int, default=65, help="tree size N of the verify pass")
    p.add_argument("--chunk", type=int, default=None, help="prefill chunk (new code only)")
    p.add_argument("--taps", default="1", help="comma-separated tap layers")
    args = p.parse_args(argv)

    cfg = preset(args.preset, num_layers=args.layers)
    taps = tuple(int(t) for t in args.taps.split(",") if t)
    abstract = nnx.eval_shape(lambda: Target(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    b, t, n = args.batch, args.prompt, args.nodes
    cache = jax.eval_shape(lambda: abstract.init_cache(b, args.cache))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    kw = {} if args.chunk is None else {"chunk": args.chunk}
    if kw and "chunk" not in inspect.signature(Target.prefill).parameters:
        raise SystemExit("this Target.prefill has no chunk argument")

    def prefill(state, cache, tokens_BT, lengths_B):
        model = nnx.merge(graphdef, state)
        return model.prefill(cache, tokens_BT, lengths_B, taps=taps, **kw)

    def verify(state, cache, tokens_BN, depths_BN, anc_BNN, start_B):
        model = nnx.merge(graphdef, state)
        return model.verify_tree(cache, tokens_BN, depths_BN, anc_BNN, start_B, taps=taps)

    print(f"{args.preset} x{args.layers} layers, B {b}, prompt {t}, cache {args.cache}, "
          f"chunk {args.chunk}, float32, backend {jax.default_backend()}")
    gib, sec = _temp_gib(prefill, state, cache, i32(b, t), i32(b))
    print(f"prefill    temp {gib:8.3f} GiB   (compile {sec:.1f} s)")
    anc = jax.ShapeDtypeStruct((b, n, n), jnp.bool_)
    gib, sec = _temp_gib(verify, state, cache, i32(b, n), i32(b, n), anc, i32(b))
    print(f"verify N{n:<3d} temp {gib:8.3f} GiB   (compile {sec:.1f} s)")


if __name__ == "__main__":
    main()
