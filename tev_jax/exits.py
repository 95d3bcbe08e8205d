"""How the command lines end: exit codes, interrupts in one line, errors that name flags.

Shared by ``tev-jax`` (`tev_jax.cli`) and ``tev-train`` (``train/__main__.py``): a bad
input or a refused run ends with one line on stderr and `EXIT_USAGE`; SIGTERM is raised
like Ctrl-C (`signals_as_interrupts`), and a run that stopped with its work on disk ends
with `EXIT_RESUMABLE`; a library error that names a Python setting is rewritten to name
the flag the user typed (`flag_names`, `name_flags`).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import gc
import importlib.util
import os
import re
import signal
import sys
import threading
import time

# Exit codes of both command lines (tev-jax, tev-train), documented in README.md.
EXIT_USAGE = 2          # bad input or a refused run: one line on stderr, nothing written
EXIT_RESUMABLE = 75     # interrupted or preempted with its work on disk (sysexits'
                        # EX_TEMPFAIL): run the same command again to resume
EXIT_SIGNAL = 128       # + the signal number: interrupted with nothing to resume


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt (`signals_as_interrupts`)."""


class Interrupted(KeyboardInterrupt):
    """A job stopped by SIGINT / SIGTERM (its ``__cause__``) whose message says what is
    on disk; the command ends with `EXIT_RESUMABLE`: rerunning it resumes."""


# The jax calls that wait, interruptibly, for native work on XLA's threads: a compile.
# Raising KeyboardInterrupt inside them lets the interpreter finalize (and jax's atexit
# destroy the backend) while the compile still runs on its thread, which then crashes
# the process with a segfault (exit 139) instead of the interrupt's exit code.
NATIVE_WAITS = (("compiler.py", "backend_compile_and_load"),)
_POLL_SECONDS = 0.02


def in_native_wait(frame) -> bool:
    """Whether ``frame`` (or a caller) is one of jax's interruptible native waits."""
    while frame is not None:
        code = frame.f_code
        if any(code.co_name == name and os.path.basename(code.co_filename) == file
               for file, name in NATIVE_WAITS):
            return True
        frame = frame.f_back
    return False


def _package_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], "")


# Whose ``try: ... except:`` blocks hold a signal (`in_catch_all`): jax's and jaxlib's.
# (Elsewhere a catch-all often keeps the exception and raises it later, as pytest's
# plugin calls do, which a reading of the source cannot tell from dropping it.)
CATCH_ALL_IN = tuple(d for d in map(_package_dir, ("jax", "jaxlib")) if d)
_SPANS: dict[str, tuple[tuple[int, int], ...]] = {}


def catch_all_spans(filename: str, parse: bool = True) -> tuple[tuple[int, int], ...]:
    """(first, last) lines of the ``try`` bodies in the Python file ``filename`` whose
    handler takes every exception (``except:``, ``except BaseException``) and does not
    raise again: an interrupt raised inside one is dropped. () for a file that is not
    Python source (a frozen module, a C extension), or not read yet when ``parse`` is
    False (the helper thread's check: Python 3.11's parser must not run on two threads
    at once, so only the main thread parses)."""
    if filename in _SPANS or not parse:
        return _SPANS.get(filename, ())
    try:
        with open(filename, "rb") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        tree = ast.Module(body=[], type_ignores=[])
    spans = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        for handler in node.handlers:
            names = {n.id for n in ast.walk(handler.type)
                     if isinstance(n, ast.Name)} if handler.type else {"BaseException"}
            if ("BaseException" in names
                    and not any(isinstance(n, ast.Raise) for n in ast.walk(handler))):
                spans.append((node.body[0].lineno, node.body[-1].end_lineno))
                break
    _SPANS[filename] = tuple(spans)
    return _SPANS[filename]


def in_catch_all(frame, parse: bool = True) -> bool:
    """Whether ``frame`` (or a caller) runs inside one of jax's ``try`` blocks that would
    drop an interrupt (`CATCH_ALL_IN`, `catch_all_spans`): jax reads a compiled
    program's layouts and shardings in ``try: ... except:``, and a SIGINT raised there,
    just after a compile, was lost (the command ran on and ended with 0)."""
    while frame is not None:
        file, line = frame.f_code.co_filename, frame.f_lineno
        if file.startswith(CATCH_ALL_IN) and any(
                a <= line <= b for a, b in catch_all_spans(file, parse)):
            return True
        frame = frame.f_back
    return False


def in_swallowing_call(frame) -> bool:
    """Whether ``frame`` (or a caller) runs where Python reports an exception and drops
    it ("Exception ignored in ..."): a garbage-collector callback (jax has one), a
    ``__del__`` or our own ``sys.unraisablehook``. An interrupt raised there would be
    lost."""
    callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
    while frame is not None:
        if (frame.f_code in callbacks or frame.f_code.co_name == "__del__"
                or frame.f_code is _redeliver_dropped.__code__):
            return True
        frame = frame.f_back
    return False


def in_import(frame) -> bool:
    """Whether ``frame`` (or a caller) runs an import. An interrupt raised there can
    break a C extension's initialisation (an ImportError, which an optional import then
    swallows; or a crash), so it waits for the import to finish."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def _must_wait(frame, parse: bool = True) -> bool:
    return (in_native_wait(frame) or in_catch_all(frame, parse) or in_swallowing_call(frame)
            or in_import(frame))


def _deliver_later(signum: int) -> None:
    """Waits (on a helper thread) until the main thread has left the compile, the
    catch-all ``try``, the callback or the import, then sends ``signum`` to it again (a
    real signal: it also ends a sleep or a blocking read there, as the first one would
    have)."""
    main = threading.main_thread().ident
    while _must_wait(sys._current_frames().get(main), parse=False):
        time.sleep(_POLL_SECONDS)
    signal.pthread_kill(main, signum)


def _interrupt(signum, frame):
    """The handler of `signals_as_interrupts` and `refine_default_interrupt`."""
    if _must_wait(frame):
        threading.Thread(target=_deliver_later, args=(signum,),
                         name="tev-jax-deferred-signal", daemon=True).start()
        return
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _redeliver_dropped(next_hook, unraisable) -> None:
    """Our ``sys.unraisablehook`` (as ``partial(_redeliver_dropped, next_hook)``) while
    our handlers are in place: an interrupt that Python reported and dropped ("Exception
    ignored in ...": a weakref callback, an atexit function, a callback
    `in_swallowing_call` does not know) is sent again once the main thread has left
    this hook, instead of being lost (the command ran on and ended with 0); anything
    else goes to ``next_hook``."""
    exc = unraisable.exc_value
    if not isinstance(exc, KeyboardInterrupt):
        next_hook(unraisable)
        return
    signum = signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT
    threading.Thread(target=_deliver_later, args=(signum,),
                     name="tev-jax-deferred-signal", daemon=True).start()


def refine_default_interrupt() -> bool:
    """Replaces Python's default SIGINT handler, and only that one, with `_interrupt`:
    Ctrl-C still raises KeyboardInterrupt, but not inside jax's compile call, a ``try``
    that drops every exception, a garbage-collector callback or an import, where it
    would crash the process or be dropped (jax's callback runs often while jax and its
    users import: Ctrl-C in the first seconds of a command was lost half the time;
    inside jaxlib's initialisation
    it became an ImportError, or a segfault). ``import tev_jax`` calls it, before it
    imports jax. A handler of your own is left alone, and so is a thread other than the
    main one; -> whether it replaced the handler."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return False
    signal.signal(signal.SIGINT, _interrupt)
    if sys.unraisablehook is sys.__unraisablehook__:
        sys.unraisablehook = functools.partial(_redeliver_dropped, sys.__unraisablehook__)
    return True


@contextlib.contextmanager
def signals_as_interrupts():
    """Turns SIGINT into KeyboardInterrupt and SIGTERM into `Terminated` (a
    KeyboardInterrupt) while the block runs, so a terminated command ends like an
    interrupted one: its work so far on disk, one line on stderr. A signal that arrives
    while jax waits for a compile is raised once the compile has returned (`NATIVE_WAITS`),
    so that no XLA thread still runs when the interpreter exits, one that arrives inside
    a ``try`` whose ``except:`` would drop it once the ``try`` is left (`in_catch_all`),
    one that arrives in a garbage-collector callback or ``__del__`` once that has
    returned, so that it is not dropped (`in_swallowing_call`), and one that arrives in
    an import once the import is done (`in_import`); one that Python still drops
    anywhere else (a weakref callback, ...) is sent again (``sys.unraisablehook``). A
    signal the process ignores (started by ``nohup`` or as a background job) stays
    ignored. A no-op off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    # a SIGINT the process was started ignoring (nohup, a background job) stays ignored
    signals = [s for s in (signal.SIGINT, signal.SIGTERM)
               if signal.getsignal(s) != signal.SIG_IGN]
    previous = {sig: signal.signal(sig, _interrupt) for sig in signals}
    previous_hook = sys.unraisablehook
    sys.unraisablehook = functools.partial(_redeliver_dropped, previous_hook)
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def interrupt_exit(e: BaseException | None) -> tuple[str, int]:
    """(what stopped the command, its exit code when nothing resumable was left)."""
    if isinstance(e, Terminated):
        return "terminated (SIGTERM)", EXIT_SIGNAL + signal.SIGTERM
    return "interrupted (SIGINT)", EXIT_SIGNAL + signal.SIGINT


def parse_args(parser: argparse.ArgumentParser, subcommands, argv=None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, except that a flag the subcommand does not know is
    refused with that subcommand's usage (argparse shows the top-level one).

    Args:
      subcommands: the action ``parser.add_subparsers`` returned.
    """
    args, extra = parser.parse_known_args(argv)
    if extra:
        chosen = subcommands.choices[getattr(args, subcommands.dest)]
        chosen.error(f"unrecognized arguments: {' '.join(extra)}")
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
    raised by the library's configs name what the user typed."""
    for name in sorted(flags, key=len, reverse=True):
        flag = flags[name]
        message = re.sub(rf"(?<![\w-]){re.escape(name)}=(True|False)\b",
                         lambda m: f"{flag} {m.group(1).lower()}", message)
        message = re.sub(rf"(?<![\w-]){re.escape(name)}(?=\s+must\b|\s+is required\b|=)",
                         flag, message)
        if "_" in name:  # "max_new_tokens (256)"; plain words stay words
            message = re.sub(rf"(?<![\w-]){re.escape(name)}(?= \()", flag, message)
        message = re.sub(rf"(?<=another ){re.escape(name)}\b", flag, message)
        message = re.sub(rf"(?<=lower ){re.escape(name)}(?= \()", flag, message)
    return re.sub(r"(?<=\S) or None\b", " or unset", message)  # a flag is unset, not None


__all__ = ["CATCH_ALL_IN", "EXIT_RESUMABLE", "EXIT_SIGNAL", "EXIT_USAGE", "Interrupted",
           "NATIVE_WAITS", "Terminated", "catch_all_spans", "flag_names", "in_catch_all",
           "in_import", "in_native_wait", "in_swallowing_call", "interrupt_exit",
           "name_flags", "parse_args", "refine_default_interrupt", "signals_as_interrupts"]
