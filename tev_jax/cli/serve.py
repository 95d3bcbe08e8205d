"""``tev-jax serve``: the OpenAI-compatible server (`tev_jax.server`)."""

from __future__ import annotations

import os
import sys

from tev_jax.cli import flags
from tev_jax.runtime.exit_codes import EXIT_USAGE

SERVE_EXTRA = 'the server needs the serve extra: pip install -e ".[serve]"'
API_KEY_ENV = "TEV_JAX_API_KEY"


def serve_command(args) -> int:
    """Parses the flags into `tev_jax.server.run.ServeOptions` and serves."""
    from tev_jax.decode import DecodeConfig
    from tev_jax.models.bundled import is_bundled_target

    try:
        from tev_jax.server import run
    except ImportError as e:
        print(f"tev-jax serve: {SERVE_EXTRA} ({e})", file=sys.stderr)
        return EXIT_USAGE
    flags.at_least_one(args, "--max-batch", "--max-tokens", "--max-prompt-tokens",
                       "--mesh-data", "--mesh-fsdp", "--mesh-tensor")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be a TCP port, 1 to 65535 (0: any free port), got "
                         f"{args.port}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not 0 < args.max_body_mb <= 4096:
        raise ValueError(f"--max-body-mb must be in (0, 4096], got {args.max_body_mb}")
    api_key = args.api_key if args.api_key is not None else (
        os.environ.get(API_KEY_ENV) or None)  # set but empty: no key
    if api_key is not None and (not api_key.strip() or api_key != api_key.strip()):
        raise ValueError("--api-key (or TEV_JAX_API_KEY) must be a non-empty key without "
                         "surrounding spaces")
    if args.verifier == "greedy":
        raise ValueError("--verifier greedy is exact at temperature 0 only; a server takes "
                         "any temperature (use tev, predraw or sequential)")
    if args.tuning is not None and args.budget != "auto":
        raise ValueError("--tuning is read with --budget auto")
    if args.batch_invariant and args.budget == "auto":
        raise ValueError("--batch-invariant needs a fixed --budget (an automatic one "
                         "changes the tree with the live rows)")
    if args.budget == "auto" and args.tuning is None:
        raise ValueError("--budget auto needs --tuning FILE (the file that tev-jax tune "
                         "--json FILE writes)")
    config = DecodeConfig(builder=args.builder, budget=args.budget, tuning=args.tuning,
                          verifier=args.verifier, max_new_tokens=args.max_tokens,
                          prompt_len=args.max_prompt_tokens, prefill_chunk=args.prefill_chunk)
    target, drafter, where = flags.checkpoint_dirs(args)
    options = run.ServeOptions(
        target=target, drafter=drafter, config=config, model=args.model_name or
        ("tev-jax-bundled" if is_bundled_target(args.target) else args.target),
        host=args.host, port=args.port, max_batch=args.max_batch, max_queue=args.max_queue,
        drain_seconds=args.drain_seconds, seed=args.seed, dtype=args.dtype,
        mesh=(args.mesh_data, args.mesh_fsdp, args.mesh_tensor), warmup=args.warmup, batch_invariant=args.batch_invariant,
        api_key=api_key, max_body_bytes=int(args.max_body_mb * 2**20),
        spec_metrics=args.per_request_spec_decode_metrics == "summary")
    print(f"tev-jax serve: {where}; {flags.method_label(config)}", file=sys.stderr)
    return run.serve(options)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server with continuous batching",
                       description="Serves POST /v1/completions and /v1/chat/completions "
                                   "(streaming with stream: true), GET /v1/models and "
                                   "GET /health, decoding with continuous batching and "
                                   "exact tree verification at any temperature.")
    p.add_argument("--target", default=None,
                   help="target checkpoint directory; default: the bundled demo target")
    p.add_argument("--drafter", default=None,
                   help="drafter checkpoint directory or bundled:NAME; default: the "
                        "bundled ExitTrain drafter with the bundled target")
    flags.add_tree_flags(p)
    p.add_argument("--verifier", choices=("tev", "predraw", "sequential"), default="tev",
                   help="exact tree verifier (default %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default %(default)s)")
    p.add_argument("--port", type=int, default=8000,
                   help="port, 1 to 65535, or 0 for any free port (the one taken is "
                        "printed; default %(default)s)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="live requests decoded together (row slots; default %(default)s)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a slot; more get 429 (default "
                        "%(default)s)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="the most new tokens a request may ask for (the cache's output "
                        "part; default %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=512,
                   help="the longest prompt in tokens (default %(default)s)")
    p.add_argument("--model-name", default=None,
                   help="the model id clients send (default: tev-jax-bundled, or --target)")
    p.add_argument("--drain-seconds", type=float, default=0.0,
                   help="on SIGTERM, let running requests go on this long before cutting "
                        "them (default %(default)s: at the end of the current round)")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="prefill prompts in chunks of this many tokens (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the scheduler's sampling seed")
    p.add_argument("--warmup", action="store_true",
                   help="compile every program (each slot count, prompt bucket and move "
                        "between slot counts; sampling settings are values, so that is "
                        "all any request needs) before listening; default: each when "
                        "first met")
    p.add_argument("--batch-invariant", action="store_true",
                   help="a request's numbers never depend on its batch, so a seed holds "
                        "bit for bit: every round on the --max-batch program, every prompt "
                        "prefilled alone (needs a fixed --budget; slower for few requests)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="parameter and KV-cache dtype (default %(default)s)")
    flags.add_mesh_flags(p)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every /v1 route (401 "
                        f"without it; /health stays open); default: ${API_KEY_ENV} if set, "
                        "else none")
    p.add_argument("--per-request-spec-decode-metrics", choices=("off", "summary"),
                   default="off",
                   help="summary: every response carries its speculative decoding, in "
                        "vLLM's shape ('metrics': {'speculative_decoding': ...}: tree "
                        "rounds, draft tokens verified and accepted, the histogram of "
                        "accepted tokens per round; default %(default)s)")
    p.add_argument("--max-body-mb", type=float, default=8.0,
                   help="the largest request body read, in MiB; larger bodies get 413 "
                        "(default %(default)s)")
    p.set_defaults(func=serve_command)
