"""The ``tev-jax`` command line: one small module per subcommand.

Each subcommand parses its arguments into library objects and calls the library; the
work lives in ``tev_jax`` (`tev_jax.engine`, `tev_jax.costs.timing`, `tev_jax.batch.job`,
`tev_jax.costs.plan`, `tev_jax.server`). The flags several subcommands share are declared and
read in `tev_jax.cli.flags`. Add a subcommand by writing a module whose ``add_parser(subparsers)``
registers its arguments and sets ``func``, and listing it in `subcommands`.

`main` handles SIGINT and SIGTERM before it imports anything heavy (`tev_jax.runtime.signals`): a
signal is recorded, and the command stops at its next safe point with one line.
"""

from __future__ import annotations

import argparse
import sys

from tev_jax.runtime import signals
from tev_jax.runtime.exit_codes import (EXIT_RESUMABLE, EXIT_USAGE, Interrupted, flag_names,
                                        interrupt_exit, name_flags, parse_args)

DESCRIPTION = ("Tree speculative decoding with exact verifiers: generate text, compare "
               "methods, plan memory, tune the tree budget, show the exit law.")


def subcommands() -> list:
    """The subcommands' ``add_parser`` functions (their modules import jax only inside
    the commands, so the command line is parsed before jax starts)."""
    from tev_jax.cli import compare, exit_law, generate, merge_outputs, plan, serve, tune

    return [exit_law.add_parser, generate.add_parser, compare.add_parser, plan.add_parser,
            tune.add_parser, merge_outputs.add_parser, serve.add_parser]


def main(argv: list[str] | None = None) -> int:
    """The ``tev-jax`` command. Exit codes: 0 done; 2 bad input or a refused run (one
    line on stderr); 75 a batch job interrupted (SIGINT / SIGTERM) with its results so far
    on disk: rerun to resume; 130 / 143 any other command interrupted / terminated."""
    with signals.handled_signals("tev-jax"):
        return _main(argv)


def run() -> None:
    """The ``tev-jax`` executable: `main`, then exit with its code; a signal while the
    interpreter exits ends it with that code at once (`tev_jax.runtime.signals.exit_quietly`)."""
    try:
        code = main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else EXIT_USAGE
    signals.exit_quietly(code)
    sys.exit(code)


def _main(argv: list[str] | None) -> int:
    from tev_jax import __version__

    command, args = "tev-jax", None
    parser = argparse.ArgumentParser(prog="tev-jax", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"tev-jax {__version__}")
    try:
        sub = parser.add_subparsers(dest="command", required=True)
        for add in subcommands():  # their modules import no jax: help, --version and
            add(sub)               # usage errors answer at once
        signals.check()
        args = parse_args(parser, sub, argv)
        command = f"tev-jax {args.command}"
        from tev_jax.runtime.platforms import quiet_start

        quiet_start()  # before jax is imported: no libtpu / CUDA plugin lines on a CPU
        signals.check()
        code = args.func(args)
        if not code:
            signals.note_late(command)  # a signal the command's last stretch did not take
        return code
    except KeyboardInterrupt as e:
        what, code = interrupt_exit(e.__cause__ if isinstance(e, Interrupted) else e)
        if isinstance(e, Interrupted):
            print(f"{command}: {what}; {e}", file=sys.stderr)
            return EXIT_RESUMABLE
        if getattr(args, "output", None):  # a batch job, before it started: a rerun starts it
            print(f"{command}: {what} before anything was written: run the same command "
                  "again to start it", file=sys.stderr)
            return EXIT_RESUMABLE
        print(f"{command}: {what}", file=sys.stderr)
        return code
    except ValueError as e:
        raise _fail(command, name_flags(str(e), flag_names(parser))) from None
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        raise _fail(command, f"{where}{e.strerror or e}") from None


def _fail(command: str, message: str) -> SystemExit:
    print(f"{command}: error: {message}", file=sys.stderr)
    return SystemExit(EXIT_USAGE)
