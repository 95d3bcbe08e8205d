"""How the command lines end: exit codes, interrupts in one line, errors that name flags.

Shared by ``tev-jax`` (`tev_jax.cli`) and ``tev-train`` (``train/__main__.py``): a bad
input or a refused run ends with one line on stderr and `EXIT_USAGE`; a signal, taken at
a safe point (`tev_jax.runtime.signals`), ends a run that stopped with its work on disk with
`EXIT_RESUMABLE` and any other with 128 + the signal; a library error that names a
Python setting is rewritten to name the flag the user typed (`flag_names`, `name_flags`).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import signal

# Exit codes of both command lines (tev-jax, tev-train), documented in README.md.
EXIT_USAGE = 2          # bad input or a refused run: one line on stderr, nothing written
EXIT_RESUMABLE = 75     # interrupted or preempted with its work on disk (sysexits'
                        # EX_TEMPFAIL): run the same command again to resume
EXIT_SIGNAL = 128       # + the signal number: interrupted with nothing to resume


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt at a safe point (`tev_jax.runtime.signals`)."""


class Interrupted(KeyboardInterrupt):
    """A job stopped by SIGINT / SIGTERM (its ``__cause__``) whose message says what is
    on disk; the command ends with `EXIT_RESUMABLE`: rerunning it resumes."""


def interrupt_exit(e: BaseException | None) -> tuple[str, int]:
    """(what stopped the command, its exit code when nothing resumable was left)."""
    if isinstance(e, Terminated):
        return "terminated (SIGTERM)", EXIT_SIGNAL + signal.SIGTERM
    return "interrupted (SIGINT)", EXIT_SIGNAL + signal.SIGINT


def parse_args(parser: argparse.ArgumentParser, subcommands, argv=None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, except that a flag the subcommand does not know is
    refused with that subcommand's usage (argparse shows the top-level one) and the
    closest flag it does know (``--budjet (did you mean --budget?)``).

    Args:
      subcommands: the action ``parser.add_subparsers`` returned.
    """
    args, extra = parser.parse_known_args(argv)
    if extra:
        chosen = subcommands.choices[getattr(args, subcommands.dest)]
        known = [o for action in chosen._actions for o in action.option_strings]
        hints = [f"{x} (did you mean {close[0]}?)"
                 if x.startswith("-") and (close := difflib.get_close_matches(
                     x.split("=", 1)[0], known, n=1, cutoff=0.7)) else x for x in extra]
        chosen.error(f"unrecognized arguments: {' '.join(hints)}")
    return args


def flag_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Python names (argparse dests) -> their ``--flags``, over every subcommand."""
    names = {}
    parsers = [parser]
    while parsers:
        p = parsers.pop()
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers += list(action.choices.values())
            long = [o for o in action.option_strings if o.startswith("--")]
            if long and action.dest not in (argparse.SUPPRESS, "help", "version"):
                names.setdefault(action.dest, long[0])
    return names


def name_flags(message: str, flags: dict[str, str]) -> str:
    """``message`` with the Python names of settings written as their flags.

    A name followed by "must", "is required" or ``=value``, or after "another", becomes
    its ``--flag`` (``name=False`` becomes ``--flag false``), and so does a name with an
    underscore, or after "lower", followed by a value in parentheses (``max_new_tokens
    (256)``, ``lower budget (64)``), and "or None" reads "or unset", so errors
    raised by the library's configs name what the user typed. A name inside a path
    (``./tuning.json must ...``) stays as it is."""
    for name in sorted(flags, key=len, reverse=True):
        flag = flags[name]
        message = re.sub(rf"(?<![\w./-]){re.escape(name)}=(True|False)\b",
                         lambda m: f"{flag} {m.group(1).lower()}", message)
        message = re.sub(rf"(?<![\w./-]){re.escape(name)}(?=\s+must\b|\s+is required\b|=)",
                         flag, message)
        if "_" in name:  # "max_new_tokens (256)"; plain words stay words
            message = re.sub(rf"(?<![\w./-]){re.escape(name)}(?= \()", flag, message)
        message = re.sub(rf"(?<=another ){re.escape(name)}\b", flag, message)
        message = re.sub(rf"(?<=lower ){re.escape(name)}(?= \()", flag, message)
    return re.sub(r"(?<=\S) or None\b", " or unset", message)  # a flag is unset, not None


def check_readable(path: str | None, flag: str, what: str, *,
                   folder: bool | None = None) -> None:
    """Before any work: a ValueError naming ``flag`` and ``path`` as typed (``./x`` stays
    ``./x``) unless ``path`` exists and can be read: a folder where ``folder`` is True, a
    file where it is False, either where None. ``what`` names the thing in the message
    (``--prompts ./x.jsonl: no such prompts file``). None, remote paths (``gs://...``,
    checked where they are opened) and the bundled models' names (``bundled``,
    ``bundled:NAME``) pass."""
    if path is None or "://" in str(path) or str(path) == "bundled" or str(
            path).startswith("bundled:"):
        return
    why = None
    if not os.path.exists(path):
        why = f"no such {what}"
    elif folder is True and not os.path.isdir(path):
        why = f"a file, not a {what}"
    elif folder is False and os.path.isdir(path):
        why = f"a folder, not a {what}"
    elif not os.access(path, os.R_OK | (os.X_OK if os.path.isdir(path) else 0)):
        why = "cannot read it (permission denied)"
    if why:
        raise ValueError(f"{flag} {path}: {why}")

__all__ = ["EXIT_RESUMABLE", "EXIT_SIGNAL", "EXIT_USAGE", "Interrupted", "Terminated",
           "flag_names", "interrupt_exit", "check_readable", "name_flags", "parse_args"]
