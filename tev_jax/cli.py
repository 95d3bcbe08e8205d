"""The ``tev-jax`` command line: one small function per subcommand.

Each subcommand parses its arguments into library objects and calls the library; the
work lives in ``tev_jax`` (`tev_jax.engine`, `tev_jax.profile`, `tev_jax.serve`,
`tev_jax.plan`). The decoding flags are declared once (`add_decode_flags`, choices from
the builder and verifier registries of `tev_jax.extensions`) and read once
(`decode_config`). Add a subcommand by writing ``_add_<name>(subparsers)`` that
registers its arguments and sets ``func``, and listing it in ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tev_jax import extensions
from tev_jax.budget import AutoBudget, resolve_budget
from tev_jax.decode import DecodeConfig
from tev_jax.exits import (EXIT_RESUMABLE, EXIT_USAGE, flag_names, interrupt_exit,
                           name_flags, signals_as_interrupts)
from tev_jax.exit_law import exit_law
from tev_jax.plan import DECODE_PROGRAMS as PROGRAMS_TO_PLAN
from tev_jax.plan import PRESETS
from tev_jax.sampling import Sampling, check_finite
from tev_jax.tree import make_tree, render
from tev_jax.verify import tev

# The demo tree: the last committed word is "the"; the drafter proposed these
# continuations (slot order = a best-first builder's order).
_DEMO_WORDS = ["the", "cat", "dog", "sat", "ran", "on", "mat", "away", "a", "end"]
_DEMO_TOKENS = [0, 1, 2, 3, 4, 3, 5, 7, 0]
_DEMO_PARENTS = [-1, 0, 0, 1, 1, 2, 3, 4, 6]
#   the ─┬─ cat ─┬─ sat ── on ── the
#        │       └─ ran ── away
#        └─ dog ── sat


def _demo_logits(seed: int) -> np.ndarray:
    """Target logits that put most (not all) mass on the drafted continuations."""
    rng = np.random.default_rng(seed)
    n, vocab = len(_DEMO_TOKENS), len(_DEMO_WORDS)
    logits = rng.normal(0.0, 0.5, (n, vocab)).astype(np.float32)
    for i in range(1, n):
        logits[_DEMO_PARENTS[i], _DEMO_TOKENS[i]] += 2.5
    return logits


def _add_sampling_flags(p, *, temperature: float) -> None:
    p.add_argument("--temperature", type=float, default=temperature,
                   help="0 = greedy (default %(default)s)")
    p.add_argument("--top-k", type=int, default=None, help="sampling: keep the k best")
    p.add_argument("--top-p", type=float, default=None, help="sampling: nucleus mass")


def _sampling_from(args) -> Sampling:
    if args.temperature == 0:
        given = [f for f, v in (("--top-k", args.top_k), ("--top-p", args.top_p)) if v is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} has no effect at --temperature 0 "
                             "(greedy decoding); drop it or set a temperature > 0")
    return Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def _at_least_one(args, *flags: str) -> None:
    """Refuses a count flag below 1 (one line naming the flag)."""
    for flag in flags:
        v = getattr(args, flag.lstrip("-").replace("-", "_"))
        if v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")


def exit_law_demo(args) -> int:
    """``tev-jax exit-law --demo``: an example tree, its exit law and some TEV draws."""
    _at_least_one(args, "--draws")
    if args.show < 0:
        raise ValueError(f"--show must be >= 0, got {args.show}")
    sampling = _sampling_from(args)
    tree = make_tree(_DEMO_TOKENS, _DEMO_PARENTS)
    horizon = int(np.asarray(tree.depths).max())
    logits = _demo_logits(args.seed)
    check_finite(logits)
    law = jax.jit(exit_law, static_argnames="sampling")(tree, logits, sampling)
    word = _DEMO_WORDS.__getitem__
    print(f"Draft tree over a {len(_DEMO_WORDS)}-word vocabulary, target {sampling}:")
    print("  P = reach, rho = local exit, w = exit weight = P * rho\n")
    print(render(tree, decode=word, annotations={"P": law.reach, "rho": law.rho, "w": law.w}))
    print(f"\nsum w = {float(law.w.sum()):.6f}   coverage C = {float(law.coverage):.4f}   "
          f"expected block length 1 + C = {float(law.expected_length):.4f}")

    draw = jax.jit(jax.vmap(functools.partial(tev, sampling=sampling, horizon=horizon),
                            in_axes=(0, None, None)))
    keys = jax.random.split(jax.random.key(args.seed), max(args.draws, 1))
    verdicts = jax.device_get(draw(keys, tree, logits))
    tokens = np.asarray(tree.tokens)
    print(f"\nTEV draws (exit ~ w, bonus from the exit's residual), seed {args.seed}:")
    for b in range(min(args.show, args.draws)):
        path = [int(s) for s in verdicts.path[b] if s >= 0]
        block = [word(int(tokens[s])) for s in path[1:]] + [f"[{word(int(verdicts.bonus[b]))}]"]
        print(f"  exit slot {int(verdicts.exit_node[b])}: {' '.join(block)}")
    print(f"\nmean block length over {args.draws} draws = {verdicts.length.mean():.4f} "
          f"(exact: {float(law.expected_length):.4f})")
    return 0


def _add_exit_law(sub) -> None:
    p = sub.add_parser("exit-law", help="show the canonical exit law of a draft tree")
    p.add_argument("--demo", action="store_true", required=True,
                   help="use the built-in example tree and synthetic target logits")
    _add_sampling_flags(p, temperature=1.0)
    p.add_argument("--draws", type=int, default=10_000, help="TEV draws for the mean length")
    p.add_argument("--show", type=int, default=5, help="how many draws to print")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the synthetic logits and the draws (default %(default)s)")
    p.set_defaults(func=exit_law_demo)


BUNDLED_PREFIX = "bundled:"


def _checkpoint_dirs(args) -> tuple[str, str | None, str]:
    """(target dir, drafter dir or None, description) from the flags and the bundle.

    ``--drafter bundled:NAME`` picks one of the bundled drafters (with the bundled
    target); no ``--drafter`` means the bundled default (ExitTrain).
    """
    from tev_jax.models.bundled import DEFAULT_DRAFTER, bundled_paths, check_drafter_name

    needs_drafter = args.builder != "none"
    name = None
    if args.drafter is None or args.drafter.startswith(BUNDLED_PREFIX):
        name = DEFAULT_DRAFTER if args.drafter is None else args.drafter[len(BUNDLED_PREFIX):]
        check_drafter_name(name)
    if args.target is None:
        paths = bundled_paths(drafters=(name,) if needs_drafter and name else ())
        drafter = paths.drafters[name] if name is not None else args.drafter
        where = "bundled target" + (
            "" if not needs_drafter else
            f" + bundled {name} drafter" if name is not None else f" + drafter {args.drafter}")
        return str(paths.target), str(drafter) if needs_drafter else None, where
    if needs_drafter and name is not None:
        raise ValueError(f"--drafter is required with --target and --builder {args.builder}: "
                         "the bundled drafters only fit the bundled target (or use "
                         "--builder none for plain autoregressive decoding)")
    where = f"target {args.target}" + (f" + drafter {args.drafter}" if needs_drafter else "")
    return args.target, args.drafter if needs_drafter else None, where


def _budget(text: str) -> int | str:
    """``--budget``: a positive int, or 'auto' (with ``--tuning``)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int or 'auto', got {text!r}") from None


def add_decode_flags(p, *, max_new_tokens: int = 256, tree: bool = True) -> None:
    """The flags of a `DecodeConfig` (the builder and verifier choices are the
    registries' names); ``tree=False`` leaves out the tree's (builder, budget, tuning)."""
    if tree:
        _add_tree_flags(p)
    p.add_argument("--verifier", choices=tuple(extensions.VERIFIERS), default="tev",
                   help="exact tree verifier (default %(default)s; greedy: T = 0 only)")
    _add_sampling_flags(p, temperature=0.0)
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                   help="at most this many (default %(default)s); stops at <|end|> / <|eos|>")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="prefill the prompt in chunks of this many tokens (bounded memory; "
                        "default %(default)s)")


def _add_tree_flags(p) -> None:
    p.add_argument("--builder", choices=tuple(extensions.BUILDERS), default="ddtree",
                   help="ddtree (default), chain (plain DFlash) or none (autoregressive)")
    p.add_argument("--budget", type=_budget, default=64,
                   help="DDTree node budget (default %(default)s), or auto: the best budget "
                        "for the batch size from --tuning (plain AR where that is faster)")
    p.add_argument("--tuning", default=None, metavar="FILE",
                   help="with --budget auto: a tuning file of `tev-jax tune --json FILE`")


def decode_config(args, **fields) -> DecodeConfig:
    """The `DecodeConfig` of `add_decode_flags`'s flags (the tree's at their defaults
    where the command has none); ``fields`` override or add."""
    tree = {k: getattr(args, k) for k in ("builder", "budget", "tuning") if hasattr(args, k)}
    if tree.get("tuning") is not None and tree["budget"] != "auto":
        raise ValueError("--tuning is read with --budget auto")
    return DecodeConfig(**tree | {
        "max_new_tokens": args.max_new_tokens, "verifier": args.verifier,
        "sampling": _sampling_from(args), "prefill_chunk": args.prefill_chunk} | fields)


def _method(config: DecodeConfig, auto: str | None = None) -> str:
    how = "" if auto is None else f", auto from {auto}"
    if config.builder == "none":
        return f"autoregressive{how}"
    budget = f" (budget {config.budget}{how})" if config.builder == "ddtree" else ""
    return f"{config.builder}{budget} + {config.verifier}"


def generate_command(args) -> int:
    """``tev-jax generate PROMPT``: decode one prompt and print a summary.

    The completion goes to stdout; the summary (models, method, tokens, τ, tokens/s,
    compile time, and with ``--compare-ar`` the AR speed and the speed-up) to stderr.
    First the pre-flight check (`tev_jax.plan.check_decode_fits`): a program that would
    not fit the device's free memory is refused with one line naming the setting to
    lower, exit code 2. On a terminal a "compiling ..." line comes first and the text is
    streamed round by round (`tev_jax.profile.streamed_generate`; the pre-flight check
    is then the shapes-only `tev_jax.plan.check_decode_floor`); piped, or with
    ``--no-stream``, ``--compare-ar`` or ``--repeats``, it is printed at the end of the
    timed fused program.
    """
    if args.prompts is not None:
        return batch_generate_command(args)
    if args.prompt is None:
        raise ValueError("give a PROMPT, or --prompts FILE --output OUT.jsonl")
    batch_only = [flag for flag, given in (
        ("--output", args.output is not None), ("--summary-json", args.summary_json),
        ("--force", args.force), ("--truncate", args.truncate != "none"),
        ("--prompt-len", args.prompt_len is not None),
        ("--process-index", args.process_index is not None),
        ("--process-count", args.process_count is not None),
        ("--batch-size", args.batch_size != 8), ("--sync-rounds", args.sync_rounds != 16))
        if given]
    if batch_only:
        raise ValueError(f"{', '.join(batch_only)} only apply to batch generation "
                         "(--prompts FILE); a single PROMPT's text goes to stdout")
    if not args.prompt:
        raise ValueError("the PROMPT is empty: give some text to continue")
    _at_least_one(args, "--repeats")
    from tev_jax import plan, profile
    from tev_jax.data.tokenizer import format_chat
    from tev_jax.engine import check_context
    from tev_jax.models import load_drafter, load_target, load_tokenizer
    from tev_jax.serve import stop_token_ids

    config = decode_config(args)
    target_dir, drafter_dir, where = _checkpoint_dirs(args)
    mesh = _mesh_from(args)
    dtype = jnp.dtype(args.dtype)
    target = load_target(target_dir, dtype=dtype, mesh=mesh)
    tokenizer = load_tokenizer(target_dir)
    drafter = (None if drafter_dir is None
               else load_drafter(drafter_dir, target, dtype=dtype, mesh=mesh))
    text = format_chat(args.prompt) if args.chat else args.prompt
    prompt = tokenizer.encode(text).ids
    check_context(len(prompt), config.max_new_tokens, target.config.max_position_embeddings,
                  what="PROMPT")
    config = dataclasses.replace(config, stop_token_ids=stop_token_ids(target, tokenizer),
                                 prompt_len=max(len(prompt), 1))
    auto = config.budget.source if isinstance(config.budget, AutoBudget) else None
    config = resolve_budget(config, 1, target, drafter)
    stream = (sys.stdout.isatty() and not args.no_stream and not args.compare_ar
              and args.repeats == 1)
    if stream or sys.stderr.isatty():
        print("compiling the decode program (once per setting) ...", file=sys.stderr,
              flush=True)
    if stream:
        plan.check_decode_floor(target, drafter, config, 1, mesh=mesh)
        shown = _Shown(tokenizer, prompt)
        gen = profile.streamed_generate(target, drafter, [prompt], config, args.seed,
                                        mesh=mesh, on_round=lambda rows: shown(rows[0]))
        shown(gen.rows()[0], final=True)
        compile_s = gen.stats.compile_seconds
        timing = "streamed: one host round trip per round"
    else:
        planned = plan.check_decode_fits(target, drafter, config, 1, mesh=mesh)
        timed = functools.partial(profile.timed_generate, prompt_ids=[prompt], key=args.seed,
                                  repeats=args.repeats, mesh=mesh)
        gen = timed(target, drafter, config=config)
        compile_s = gen.stats.compile_seconds + planned.compile_seconds
        print(tokenizer.decode(prompt + gen.rows()[0]), flush=True)
        timing = "fused program" + (f", median of {args.repeats}" if args.repeats > 1 else "")
    n = int(gen.lengths[0])
    lines = [f"[{where}; {_method(config, auto)}; T={config.sampling.temperature:g}]"]
    if gen.stats.rounds == 0:
        lines.append(f"{n} new token{'s' if n != 1 else ''}: the target ended the text at "
                     "its first token, so no decode round ran (no tau, speed or speed-up "
                     "to report)")
        print("\n".join(lines), file=sys.stderr)
        return 0
    speed = n / gen.stats.seconds
    lines.append(f"{n} new tokens in {gen.stats.rounds} rounds: tau = {gen.stats.tau:.2f} "
                 f"tokens/round, {speed:.1f} tokens/s ({gen.stats.seconds:.3f} s, {timing}; "
                 f"compile {compile_s:.1f} s, not counted)")
    if args.compare_ar:
        if args.builder == "none":
            lines.append("--compare-ar: this run is already autoregressive")
        else:
            ar = timed(target, None, config=dataclasses.replace(config, builder="none"))
            ar_speed = int(ar.lengths[0]) / ar.stats.seconds
            lines.append(f"AR {ar_speed:.1f} tokens/s -> speed-up {speed / ar_speed:.2f}x "
                         "(same target, same run)")
    print("\n".join(lines), file=sys.stderr)
    return 0


class _Shown:
    """Streams ``decode(prompt + tokens)`` to stdout as the tokens grow; at the end stdout
    holds exactly what the unstreamed run prints."""

    def __init__(self, tokenizer, prompt: list[int]):
        self.tokenizer, self.prompt, self.text = tokenizer, list(prompt), ""

    def __call__(self, tokens: list[int], *, final: bool = False) -> None:
        text = self.tokenizer.decode(self.prompt + list(tokens))
        if not final:  # hold back a character whose UTF-8 bytes are not all there yet
            text = text.rstrip("\ufffd")
        if text.startswith(self.text):
            sys.stdout.write(text[len(self.text):])
            self.text = text
        elif final:  # a tokenizer that revised earlier text: print the whole of it
            sys.stdout.write("\n" + text)
        if final:
            sys.stdout.write("\n")
        sys.stdout.flush()


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="speculative decoding of one prompt or a file",
                       description="Decodes PROMPT with the bundled demo models (or "
                                   "--target/--drafter) and prints the text and a summary; "
                                   "or every prompt of --prompts FILE into --output.")
    p.add_argument("prompt", nargs="?", default=None, help="the prompt text")
    p.add_argument("--target", default=None,
                   help="target checkpoint directory (config.json, safetensors, "
                        "tokenizer.json); default: the bundled demo target")
    p.add_argument("--drafter", default=None,
                   help="DFlash drafter checkpoint directory, or bundled:exittrain / "
                        "bundled:dflash; default: the bundled ExitTrain drafter when "
                        "--target is not given")
    add_decode_flags(p)
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the chat template (one user turn)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default %(default)s)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs after the compile run (the median is reported; "
                        "default %(default)s)")
    p.add_argument("--compare-ar", action="store_true",
                   help="also time plain autoregressive decoding and report the speed-up")
    p.add_argument("--no-stream", action="store_true",
                   help="on a terminal, print the text at the end of the timed fused program "
                        "instead of streaming it round by round")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="parameter and KV-cache dtype (logits, exit law and verifier stay "
                        "float32; default %(default)s)")
    _add_mesh_flags(p)
    _add_batch_options(p)
    p.set_defaults(func=generate_command)


def _add_mesh_flags(p) -> None:
    for axis, what in (("data", "batch rows; weights whole on every device"),
                       ("fsdp", "batch rows and the weights' embed axis"),
                       ("tensor", "heads, MLP and vocabulary")):
        p.add_argument(f"--mesh-{axis}", type=int, default=1,
                       help=f"devices on the {axis} mesh axis ({what}; default 1)")


def _mesh_from(args):
    """The ('data', 'fsdp', 'tensor') mesh of the flags, or None for one device."""
    from tev_jax import sharding as shd

    axes = (args.mesh_data, args.mesh_fsdp, args.mesh_tensor)
    return None if axes == (1, 1, 1) else shd.make_mesh(*axes)


# (label, bundled drafter, builder, verifier) of `tev-jax compare`, AR first.
COMPARE_METHODS = (
    ("AR (target alone)", None, "none", "tev"),
    ("DFlash + DDTree + predraw", "dflash", "ddtree", "predraw"),
    ("ExitTrain + DDTree + TEV", "exittrain", "ddtree", "tev"),
)
COMPARE_PROMPTS = ("def fibonacci(n):",
                   "Question: Tom has 3 boxes of 12 apples. He eats 5. How many are left?\n"
                   "Answer:",
                   "The history of the printing press")


def compare_command(args) -> int:
    """``tev-jax compare [PROMPT ...]``: AR, DFlash + DDTree + predraw and ExitTrain +
    DDTree + TEV on the same prompts with the bundled models; τ and tokens/s side by side.

    Each method runs every prompt once to compile (one compilation per method: the
    prompts share a fixed prompt buffer) and ``--repeats`` timed times (the median
    counts); `tev_jax.profile.compare_methods` does the timing.
    """
    from tev_jax import profile
    from tev_jax.data.tokenizer import format_chat
    from tev_jax.models import load_drafter, load_target, load_tokenizer
    from tev_jax.models.bundled import bundled_paths
    from tev_jax.serve import stop_token_ids

    _at_least_one(args, "--repeats")
    if any(not t for t in args.prompts):
        raise ValueError("an empty PROMPT: give some text to continue")
    sampling = _sampling_from(args)
    paths = bundled_paths()
    target = load_target(paths.target)
    tokenizer = load_tokenizer(paths.target)
    texts = args.prompts or COMPARE_PROMPTS
    prompts = [tokenizer.encode(format_chat(t) if args.chat else t).ids for t in texts]
    base = DecodeConfig(max_new_tokens=args.max_new_tokens, budget=args.budget,
                        sampling=sampling, stop_token_ids=stop_token_ids(target, tokenizer),
                        prompt_len=max(len(p) for p in prompts))
    methods = [(label, None if name is None else load_drafter(paths.drafters[name], target),
                dataclasses.replace(base, builder=builder, verifier=verifier))
               for label, name, builder, verifier in COMPARE_METHODS]
    rows = profile.compare_methods(target, methods, prompts, key=args.seed,
                                   repeats=args.repeats)
    ar_speed = rows[0].tokens_per_second
    print(f"bundled target, {len(prompts)} prompt(s), T={sampling.temperature:g}, "
          f"DDTree budget {args.budget}, at most {args.max_new_tokens} new tokens each")
    print(f"{'method':28s} {'tau':>6s} {'tokens/s':>9s} {'vs AR':>6s} {'tokens':>7s}")
    for r in rows:
        print(f"{r.label:28s} {r.tau:6.2f} {r.tokens_per_second:9.1f} "
              f"{r.tokens_per_second / ar_speed:5.2f}x {r.tokens:7d}")
    if sampling.greedy:
        same = all(r.outputs == rows[0].outputs for r in rows[1:])
        print("greedy outputs identical across methods: " + ("yes" if same else
              "NO (exact verifiers must reproduce the target's greedy text)"))
    return 0


def _add_compare(sub) -> None:
    p = sub.add_parser("compare", help="AR vs DFlash + DDTree vs ExitTrain + TEV (bundled)",
                       description="Decodes the same prompts with the bundled target alone, "
                                   "with the DFlash drafter + DDTree + predraw and with the "
                                   "ExitTrain drafter + DDTree + TEV; prints tau and tokens/s.")
    p.add_argument("prompts", nargs="*", help="prompt texts (default: three examples)")
    p.add_argument("--budget", type=int, default=64,
                   help="DDTree node budget (default %(default)s)")
    _add_sampling_flags(p, temperature=0.0)
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="at most this many per prompt (default %(default)s)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default %(default)s)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs per prompt after the compile run (the median counts; "
                        "default %(default)s)")
    p.set_defaults(func=compare_command)


def _mesh_for_plan(args):
    """(mesh or None, chip, devices per chip, where) of the plan flags: over a TPU slice's
    chips with ``--topology``, GPUs with ``--gpu``, else over the local devices."""
    from tev_jax import topology

    if args.topology is None and args.gpu is None:
        try:
            mesh = _mesh_from(args)
        except ValueError as e:
            raise ValueError(f"{e} (on CPU simulate devices with XLA_FLAGS="
                             "--xla_force_host_platform_device_count=8)") from e
        return mesh, topology.local_chip(), 1, "local devices"
    mesh, tpu = topology.plan_mesh(args.topology, args.gpu, args.mesh_data, args.mesh_fsdp,
                                   args.mesh_tensor)
    hosts = f", {tpu.hosts} hosts" if tpu.hosts > 1 else ""
    return mesh, tpu.chip, tpu.devices_per_chip, f"{tpu.name} ({len(tpu.devices)} devices{hosts})"


def plan_command(args) -> int:
    """``tev-jax plan``: per-device memory and cost of the decode programs, without weights
    (local devices, or a TPU slice with ``--topology``)."""
    from tev_jax import plan

    if (args.model is None) == (args.config is None):
        raise ValueError("give exactly one of --model PRESET or --config path/config.json")
    cfg = plan.model_config(args.model or args.config, num_layers=args.layers)
    config = decode_config(args, prompt_len=args.prompt_len, max_cache_len=args.cache_len)
    mesh, chip, per_chip, where = _mesh_for_plan(args)
    dtype = jnp.dtype(args.dtype)
    programs = tuple(p.strip() for p in args.programs.split(","))
    result = plan.plan_decode_programs(
        cfg, config, args.batch, dtype=dtype, drafter_layers=args.drafter_layers, mesh=mesh,
        programs=programs, chip=chip, devices_per_chip=per_chip, ops=args.ops)
    target, drafter = plan.abstract_models(cfg, config, dtype=dtype,
                                           drafter_layers=args.drafter_layers)
    floor = plan.decode_floor(target, drafter, config, args.batch)
    hbm = plan.hbm_shortfall(result, floor, config)
    axes = {"data": args.mesh_data, "fsdp": args.mesh_fsdp, "tensor": args.mesh_tensor}
    what = {"model": args.model or args.config, "layers": cfg.num_layers,
            "batch": args.batch, "prompt_len": args.prompt_len,
            "cache_len": args.cache_len, "max_new_tokens": args.max_new_tokens,
            "builder": args.builder, "budget": args.budget, "verifier": args.verifier,
            "prefill_chunk": args.prefill_chunk, "temperature": args.temperature,
            "dtype": args.dtype, "drafter_layers": args.drafter_layers, "mesh": axes,
            "topology": args.topology, "gpu": args.gpu, "fits": hbm is None}
    record = what | result.as_dict(args.tau)
    if args.json == "-":
        print(json.dumps(record))
        return 0
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    mesh_s = " x ".join(f"{k} {v}" for k, v in axes.items() if v > 1) or "one device"
    chip_s = "" if chip is None else (f"; roofline: {chip.name}, {chip.peak_flops / 1e12:.0f} "
                                      f"TFLOP/s, {chip.hbm_bandwidth / 1e9:.0f} GB/s per chip")
    print(f"{what['model']} ({cfg.num_layers} layers, {args.dtype}), batch {args.batch}, "
          f"prompt {args.prompt_len}, cache {args.cache_len or 'auto'}, "
          f"{args.builder} budget {args.budget}, T={args.temperature:g}; {mesh_s} on "
          f"{where}{chip_s}")
    print("per device:\n" + result.format(args.tau))
    if hbm is not None:
        print(hbm)
    elif chip is not None and "generation" in result.programs:
        print(f"fits: the generation's peak {result.programs['generation'].peak_bytes / 2**30:.2f}"
              f" GiB per device is within {chip.name}'s HBM "
              f"({chip.hbm_bytes / per_chip / 2**30:.2f} GiB per device)")
    return 0


def _add_plan(sub) -> None:
    p = sub.add_parser(
        "plan", help="per-device memory and cost of the decode programs (no weights needed)",
        description="Compiles the decode programs (the whole generation, an AR step, a "
                    "round, a prefill chunk, each stage) for a model config on abstract "
                    "parameters and prints the compiler's per-device argument / temporary / "
                    "output bytes, FLOPs, bytes accessed and, on a TPU (--topology) or "
                    "GPUs (--gpu), the "
                    "roofline time. For a mesh on CPU set XLA_FLAGS="
                    "--xla_force_host_platform_device_count=8. XLA:CPU copies bfloat16 "
                    "weights to float32, so bfloat16 temporary memory on CPU overstates.")
    p.add_argument("--model", default=None, help=f"a preset: {', '.join(sorted(PRESETS))}")
    p.add_argument("--config", default=None, help="a Hugging Face config.json (or its directory)")
    p.add_argument("--layers", type=int, default=None,
                   help="plan with this many target layers (e.g. 2 for per-layer figures)")
    p.add_argument("--batch", type=int, default=1, help="B, rows decoded together (default 1)")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt buffer P")
    p.add_argument("--cache-len", type=int, default=None,
                   help="cache slots L (default: P + max-new-tokens + tree slots)")
    add_decode_flags(p)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="parameter and cache dtype (bfloat16 is honest with --topology only)")
    p.add_argument("--drafter-layers", type=int, default=1, help="DFlash drafter depth")
    _add_mesh_flags(p)
    p.add_argument("--topology", default=None, metavar="NAME",
                   help="plan for a TPU slice (e.g. v5e:2x4, v5p:2x2x2, v5e:4x4; needs the "
                        "tpu extra) instead of the local devices; the mesh flags lay it out")
    p.add_argument("--gpu", default=None, metavar="NAME",
                   help="plan for NVIDIA GPUs (h100x8, h200x8, b200x8, a100x8, h100x16; needs "
                        "the gpu extra) instead of the local devices; the mesh flags lay it out")
    p.add_argument("--programs", default=",".join(PROGRAMS_TO_PLAN),
                   help="comma-separated programs to compile (default: all of "
                        "%(default)s)")
    p.add_argument("--tau", type=float, default=None,
                   help="an expected tau: estimate tokens/s and the speed-up over AR")
    p.add_argument("--ops", type=int, default=0, metavar="N",
                   help="also compile the fused rounds loop of the AR step and of the round "
                        "and show their N largest ops (per round and once per call, with "
                        "the source line and stage that made them)")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the plan as JSON to FILE ('-': only JSON, on stdout)")
    p.set_defaults(func=plan_command)


# ---------------------------------------------------------------------------- tune


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"need comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive ints, got {text!r}")
    return values


def tune_command(args) -> int:
    """``tev-jax tune --prompts FILE``: τ(b) from the exit law, round costs and the best
    budget per batch size (`tev_jax.tune.tune`); ``--json FILE`` is the tuning file of
    ``--budget auto --tuning FILE``."""
    from tev_jax import batch_io, tune
    from tev_jax.models import load_drafter, load_target, load_tokenizer
    from tev_jax.serve import stop_token_ids

    target_dir, drafter_dir, where = _checkpoint_dirs(args)
    dtype = jnp.dtype(args.dtype)
    target = load_target(target_dir, dtype=dtype)
    tokenizer = load_tokenizer(target_dir)
    drafter = load_drafter(drafter_dir, target, dtype=dtype)
    config_file = Path(target_dir) / "tokenizer_config.json"
    chat = batch_io.chat_formatter(
        json.loads(config_file.read_text()) if config_file.is_file() else None)
    requests = batch_io.encode_records(
        batch_io.read_prompts(args.prompts), tokenizer, chat,
        vocab_size=target.config.vocab_size, prompt_len=args.prompt_len,
        truncate=args.truncate == "left", where=args.prompts)
    config = decode_config(args, prompt_len=args.prompt_len,
                           stop_token_ids=stop_token_ids(target, tokenizer))
    mesh_axes = (args.mesh_data, args.mesh_fsdp, args.mesh_tensor)
    result = tune.tune(target, drafter, [r.prompt_ids for r in requests], config,
                       budgets=args.budgets, batch_sizes=args.batch, repeats=args.repeats,
                       key=args.seed, topology=args.topology,
                       mesh_axes=None if mesh_axes == (1, 1, 1) else mesh_axes,
                       dtype=jnp.bfloat16 if args.topology else None)
    result = dataclasses.replace(result, settings=result.settings | {
        "prompts_file": args.prompts, "models": where})
    if args.json:
        result.write(args.json)
    if args.figure:
        tune.plot(result, args.figure)
    print(f"[{where}; {len(requests)} prompts, {result.settings['contexts']} contexts; "
          f"T={config.sampling.temperature:g}; costs: {result.settings['device']}]")
    print(result.format())
    return 0


_TUNE_ABOUT = (
    "Continues each prompt with the target's own text, runs one decode round at the "
    "largest budget at every position, and reads τ(b) for every smaller budget from the "
    "exit law (DDTree trees are nested); times one round per budget and batch size (or "
    "the TPU roofline with --topology); prints, per batch size, the budget with the most "
    "tokens/s, or AR where nothing beats it. --json FILE feeds `generate --budget auto "
    "--tuning FILE`.")


def _add_tune(sub) -> None:
    p = sub.add_parser("tune", description=_TUNE_ABOUT,
                       help="the best tree budget per batch size, from the exit law")
    p.add_argument("--prompts", required=True, metavar="FILE",
                   help="prompts file (as generate --prompts: JSONL or plain text)")
    p.add_argument("--target", default=None, help="target checkpoint (default: bundled)")
    p.add_argument("--drafter", default=None,
                   help="drafter checkpoint, or bundled:exittrain / bundled:dflash")
    p.add_argument("--budgets", type=_ints, default=(16, 32, 64, 128),
                   help="comma-separated DDTree budgets (default 16,32,64,128)")
    p.add_argument("--batch", type=_ints, default=(1, 8),
                   help="comma-separated batch sizes (default 1,8)")
    add_decode_flags(p, max_new_tokens=64, tree=False)
    p.add_argument("--prompt-len", type=int, default=None,
                   help="prompt buffer (default: the longest prompt)")
    p.add_argument("--truncate", choices=("none", "left"), default="none",
                   help="left: keep the last --prompt-len tokens of a longer prompt")
    p.add_argument("--repeats", type=int, default=10, help="timed passes (median)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="parameter and cache dtype (default float32)")
    p.add_argument("--topology", default=None, metavar="NAME",
                   help="costs from the TPU compiler's roofline for this slice (e.g. "
                        "v5e:2x4; tpu extra) instead of timing the local devices")
    _add_mesh_flags(p)
    p.add_argument("--json", default=None, metavar="FILE", help="write the tuning file")
    p.add_argument("--figure", default=None, metavar="PNG",
                   help="τ(b) and tokens/s(b) per batch size (plots extra)")
    p.set_defaults(func=tune_command, builder="ddtree")


# ----------------------------------------------------------------- batch generation


def _add_batch_options(p) -> None:
    g = p.add_argument_group(
        "batch generation", "--prompts FILE --output OUT.jsonl decodes every prompt of FILE "
        "with continuous batching (JSONL with id + prompt / messages / prompt_ids, or "
        "plain text, one prompt per line); a rerun resumes OUT")
    g.add_argument("--prompts", default=None, metavar="FILE",
                   help="the prompts file, or bundled:NAME for a bundled evaluation set "
                        "(mt_bench, humaneval, gsm, math)")
    g.add_argument("--output", default=None, metavar="OUT.jsonl",
                   help="results, one JSON line per prompt; settings in OUT.settings.json")
    g.add_argument("--batch-size", type=int, default=8, help="row slots (default %(default)s)")
    g.add_argument("--prompt-len", type=int, default=None,
                   help="prompt buffer in tokens (default: the longest prompt of FILE)")
    g.add_argument("--truncate", choices=("none", "left"), default="none",
                   help="left: keep the last --prompt-len tokens of a longer prompt "
                        "(default: refuse it)")
    g.add_argument("--force", action="store_true",
                   help="append to OUT even if it was written with other settings")
    g.add_argument("--summary-json", default=None, metavar="PATH",
                   help="also write the end-of-run summary as JSON")
    g.add_argument("--process-index", type=int, default=None,
                   help="this process's shard (default: jax.process_index())")
    g.add_argument("--process-count", type=int, default=None,
                   help="number of shards (default: jax.process_count()); process i takes "
                        "prompts i, i + count, ... and writes OUT.<i>-of-<count>.jsonl")
    g.add_argument("--sync-rounds", type=int, default=16,
                   help="return to the host (progress bar) at least every this many rounds")


def _process_shard(args) -> tuple[int, int]:
    if args.process_index is None and args.process_count is None:
        return jax.process_index(), jax.process_count()
    if args.process_index is None or args.process_count is None:
        raise ValueError("give both --process-index and --process-count")
    if args.process_count < 1 or not 0 <= args.process_index < args.process_count:
        raise ValueError(f"--process-index {args.process_index} is outside "
                         f"[0, --process-count {args.process_count})")
    return args.process_index, args.process_count


def batch_generate_command(args) -> int:
    """``tev-jax generate --prompts FILE --output OUT.jsonl``: continuous batching
    (`tev_jax.serve.generate_file`)."""
    from tev_jax import serve

    if args.prompt is not None:
        raise ValueError("give either a PROMPT or --prompts FILE, not both")
    if args.output is None:
        raise ValueError("--prompts needs --output OUT.jsonl")
    index, count = _process_shard(args)
    target_dir, drafter_dir, where = _checkpoint_dirs(args)
    job = serve.FileJob(
        prompts=args.prompts, output=args.output, target=target_dir, drafter=drafter_dir,
        config=decode_config(args, prompt_len=args.prompt_len),
        batch_size=args.batch_size, truncate=args.truncate == "left", force=args.force,
        seed=args.seed, dtype=args.dtype, process_index=index, process_count=count,
        sync_rounds=args.sync_rounds, method=where)
    summary = serve.generate_file(job, mesh=_mesh_from(args))
    if args.summary_json:
        try:
            Path(args.summary_json).write_text(json.dumps(summary, indent=1) + "\n")
        except OSError as e:
            raise ValueError(f"--summary-json {args.summary_json}: cannot write it "
                             f"({e.strerror or e}); the results are in {summary['output']}"
                             ) from None
    return 0


def merge_outputs_command(args) -> int:
    """``tev-jax merge-outputs OUT.jsonl``: join the per-process shards of OUT."""
    from tev_jax import batch_io

    n = batch_io.merge_outputs(args.output, force=args.force)
    print(f"{n} results -> {args.output}", file=sys.stderr)
    return 0


def _add_merge_outputs(sub) -> None:
    p = sub.add_parser("merge-outputs", help="join the shards OUT.<i>-of-<n>.jsonl into OUT",
                       description="Joins the per-process outputs of `tev-jax generate "
                                   "--prompts ... --process-count n` into OUT.jsonl.")
    p.add_argument("output", help="OUT.jsonl, as given to generate --output")
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    p.set_defaults(func=merge_outputs_command)


SUBCOMMANDS = [_add_exit_law, _add_generate, _add_compare, _add_plan, _add_tune,
               _add_merge_outputs]

def main(argv: list[str] | None = None) -> int:
    """The ``tev-jax`` command. Exit codes: 0 done; 2 bad input or a refused run (one
    line on stderr); 75 a batch job interrupted (SIGINT / SIGTERM) with its results so far
    on disk: rerun to resume; 130 / 143 a single generation interrupted / terminated."""
    from tev_jax import __version__

    parser = argparse.ArgumentParser(prog="tev-jax", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"tev-jax {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    args = parser.parse_args(argv)
    try:
        with signals_as_interrupts():
            return args.func(args)
    except KeyboardInterrupt as e:
        from tev_jax.serve import Interrupted

        what, code = interrupt_exit(e.__cause__ if isinstance(e, Interrupted) else e)
        if isinstance(e, Interrupted):
            print(f"tev-jax {args.command}: {what}; {e}", file=sys.stderr)
            return EXIT_RESUMABLE
        print(f"tev-jax {args.command}: {what}", file=sys.stderr)
        return code
    except ValueError as e:
        from tev_jax.plan import NotEnoughMemory

        message = name_flags(str(e), flag_names(parser))
        if isinstance(e, NotEnoughMemory):  # a refusal of the settings, not a usage error
            print(f"tev-jax {args.command}: {message}", file=sys.stderr)
            return EXIT_USAGE
        parser.error(message)
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        parser.error(f"{where}{e.strerror or e}")


if __name__ == "__main__":
    sys.exit(main())
