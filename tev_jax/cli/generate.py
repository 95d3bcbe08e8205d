"""``tev-jax generate PROMPT``: decode one prompt (or, with ``--prompts``, a file)."""

from __future__ import annotations

import dataclasses
import functools
import sys


from tev_jax.cli import batch, flags
from tev_jax.runtime import signals


def generate_command(args) -> int:
    """``tev-jax generate PROMPT``: decode one prompt and print a summary.

    The completion goes to stdout; the summary (models, method, tokens, τ, tokens/s,
    compile time, and with ``--compare-ar`` the AR speed and the speed-up) to stderr.
    First the pre-flight check (`tev_jax.costs.plan.check_decode_fits`): a program that would
    not fit the device's free memory is refused with one line naming the setting to
    lower, exit code 2. A "compiling ..." line comes first (on stderr); on a terminal the
    text is streamed round by round (`tev_jax.costs.timing.streamed_generate`; the pre-flight check
    is then the shapes-only `tev_jax.costs.plan.check_decode_floor`); piped, or with
    ``--no-stream``, ``--compare-ar`` or ``--repeats``, it is printed at the end of the
    timed fused program.
    """
    import jax.numpy as jnp
    from tev_jax.budget import AutoBudget, resolve_budget

    if args.prompts is not None:
        return batch.batch_generate_command(args)
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
    flags.check_text(args.prompt)
    flags.at_least_one(args, "--repeats")
    flags.check_inputs(args)
    from tev_jax.costs import plan, timing
    from tev_jax.data.tokenizer import format_chat
    from tev_jax.models import load_drafter, load_target, load_tokenizer
    from tev_jax.prompts import check_context
    from tev_jax.text_io import stop_token_ids

    config = flags.decode_config(args)
    target_dir, drafter_dir, where = flags.checkpoint_dirs(args)
    mesh = flags.mesh_from(args)
    dtype = jnp.dtype(args.dtype)
    target = load_target(target_dir, dtype=dtype, mesh=mesh,
                         attention_window=getattr(args, "attention_window", "native"))
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
    plan.check_decode_floor(target, drafter, config, 1, mesh=mesh)  # from shapes, at once
    signals.check()  # the models are loaded; the compile comes next
    print("compiling the decode program (once per setting) ...", file=sys.stderr, flush=True)
    # with --chat the turns are shown, the template's role markers as "user:" / "assistant:"
    head, shown_prompt = ((f"user: {args.prompt}\nassistant: ", []) if args.chat
                          else ("", prompt))
    if stream:
        shown = _Shown(tokenizer, shown_prompt, head)
        gen = timing.streamed_generate(target, drafter, [prompt], config, args.seed,
                                        mesh=mesh, on_round=lambda rows: shown(rows[0]))
        shown(gen.rows()[0], final=True)
        compile_s = gen.stats.compile_seconds
        how = "streamed: one host round trip per round"
    else:
        planned = plan.check_decode_fits(target, drafter, config, 1, mesh=mesh)
        timed = functools.partial(timing.timed_generate, prompt_ids=[prompt], key=args.seed,
                                  repeats=args.repeats, mesh=mesh)
        gen = timed(target, drafter, config=config)
        compile_s = gen.stats.compile_seconds + planned.compile_seconds
        print(head + text_of(tokenizer, shown_prompt + gen.rows()[0]), flush=True)
        how = "fused program" + (f", median of {args.repeats}" if args.repeats > 1 else "")
    n = int(gen.lengths[0])
    lines = [f"[{where}; {flags.method_label(config, auto)}; T={config.sampling.temperature:g}]"]
    if gen.stats.rounds == 0:
        lines.append(f"{n} new token{'s' if n != 1 else ''}: the target ended the text at "
                     "its first token, so no decode round ran (no tau, speed or speed-up "
                     "to report)")
        print("\n".join(lines), file=sys.stderr)
        return 0
    speed = n / gen.stats.seconds
    lines.append(f"{n} new tokens in {gen.stats.rounds} rounds: tau = {gen.stats.tau:.2f} "
                 f"tokens/round, {per_second(speed)} tokens/s ({gen.stats.seconds:.3f} s, "
                 f"{how}; compile {compile_s:.1f} s, not counted)")
    if args.compare_ar:
        if args.builder == "none":
            lines.append("--compare-ar: this run is already autoregressive")
        else:
            signals.check()
            ar = timed(target, None, config=dataclasses.replace(config, builder="none"))
            ar_speed = int(ar.lengths[0]) / ar.stats.seconds
            lines.append(f"AR {per_second(ar_speed)} tokens/s -> speed-up "
                         f"{speed / ar_speed:.3g}x (same target, same run)")
    print("\n".join(lines), file=sys.stderr)
    return 0


def per_second(rate: float) -> str:
    """A rate as the summary prints it: one decimal from 10 on (885.3, 88.1), three
    significant digits below (4.57, 0.0312), so that a slow run never reads 0.0."""
    return f"{rate:.1f}" if rate >= 10 else f"{rate:.3g}"


def text_of(tokenizer, ids: list[int]) -> str:
    """The decoded text without a last character whose UTF-8 bytes were cut off (by
    max-new-tokens, or not generated yet while streaming)."""
    return tokenizer.decode(ids).rstrip("\ufffd")


class _Shown:
    """Streams ``decode(prompt + tokens)`` to stdout as the tokens grow; at the end stdout
    holds exactly what the unstreamed run prints."""

    def __init__(self, tokenizer, prompt: list[int], head: str = ""):
        self.tokenizer, self.prompt, self.text = tokenizer, list(prompt), ""
        sys.stdout.write(head)

    def __call__(self, tokens: list[int], *, final: bool = False) -> None:
        text = text_of(self.tokenizer, self.prompt + list(tokens))
        if text.startswith(self.text):
            sys.stdout.write(text[len(self.text):])
            self.text = text
        elif final:  # a tokenizer that revised earlier text: print the whole of it
            sys.stdout.write("\n" + text)
        if final:
            sys.stdout.write("\n")
        sys.stdout.flush()


def add_parser(sub) -> None:
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
    flags.add_decode_flags(p)
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
    p.add_argument("--attention-window", choices=("native", "full"), default="native",
                   help="a sliding-window target's (Gemma 4) sliding layers: 'native' as "
                        "trained, or 'full' every layer global, as the DFlash authors ran "
                        "it (default %(default)s)")
    flags.add_mesh_flags(p)
    batch.add_batch_options(p)
    p.set_defaults(func=generate_command)
