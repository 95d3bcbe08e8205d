"""The ``tev-jax`` command line: one small module per subcommand.

Each subcommand parses its arguments into library objects and calls the library; the
work lives in ``tev_jax`` (`tev_jax.engine`, `tev_jax.profile`, `tev_jax.serve`,
`tev_jax.plan`, `tev_jax.server`). The flags several subcommands share are declared and read in
`tev_jax.cli.flags`. Add a subcommand by writing a module whose ``add_parser(subparsers)``
registers its arguments and sets ``func``, and listing it in ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import sys

from tev_jax.cli import compare, exit_law, generate, merge_outputs, plan, serve, tune
from tev_jax.exits import (EXIT_RESUMABLE, EXIT_USAGE, Interrupted, flag_names, interrupt_exit,
                           name_flags, parse_args, signals_as_interrupts)
from tev_jax.platforms import skip_absent_tpu

DESCRIPTION = ("Tree speculative decoding with exact verifiers: generate text, compare "
               "methods, plan memory, tune the tree budget, show the exit law.")

SUBCOMMANDS = [exit_law.add_parser, generate.add_parser, compare.add_parser, plan.add_parser,
               tune.add_parser, merge_outputs.add_parser, serve.add_parser]


def main(argv: list[str] | None = None) -> int:
    """The ``tev-jax`` command. Exit codes: 0 done; 2 bad input or a refused run (one
    line on stderr); 75 a batch job interrupted (SIGINT / SIGTERM) with its results so far
    on disk: rerun to resume; 130 / 143 a single generation interrupted / terminated."""
    from tev_jax import __version__

    parser = argparse.ArgumentParser(prog="tev-jax", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"tev-jax {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    args = parse_args(parser, sub, argv)

    def fail(message: str) -> SystemExit:
        print(f"tev-jax {args.command}: error: {message}", file=sys.stderr)
        return SystemExit(EXIT_USAGE)

    skip_absent_tpu()
    try:
        with signals_as_interrupts():
            return args.func(args)
    except KeyboardInterrupt as e:
        what, code = interrupt_exit(e.__cause__ if isinstance(e, Interrupted) else e)
        if isinstance(e, Interrupted):
            print(f"tev-jax {args.command}: {what}; {e}", file=sys.stderr)
            return EXIT_RESUMABLE
        if getattr(args, "output", None):  # a batch job, before it started: a rerun starts it
            print(f"tev-jax {args.command}: {what} before anything was written: run the "
                  "same command again to start it", file=sys.stderr)
            return EXIT_RESUMABLE
        print(f"tev-jax {args.command}: {what}", file=sys.stderr)
        return code
    except ValueError as e:
        raise fail(name_flags(str(e), flag_names(parser))) from None
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        raise fail(f"{where}{e.strerror or e}") from None
