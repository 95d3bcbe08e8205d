"""How the command lines start and end (issue 58, items 1, 2, 4, 6, 9, 10): the command
line is parsed before jax starts (help, ``--version`` and usage errors answer at once,
with the closest flag for a typo), a port outside TCP's range is refused, a signal while
the interpreter exits ends the process quietly with the command's code, and a signal
during a compile stops a generation before it decodes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from interrupting import env

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=120, **kw)


@pytest.mark.parametrize("argv, code, line", [
    (["--version"], 0, "tev-jax 0.1.0"),
    (["generate", "hello", "--budjet", "16"], 2,
     "unrecognized arguments: --budjet (did you mean --budget?) 16"),
    (["plan", "--modle", "qwen3-8b"], 2, "--modle (did you mean --model?)"),
    (["serve", "--max-batch", "4", "--bogus"], 2, "unrecognized arguments: --bogus"),
])
def test_the_command_line_answers_before_jax_is_imported(argv, code, line):
    """The answer comes from the parser alone: jax is never imported (before, every
    answer waited for jax and the TPU probe, 4.6 s here and 15 s on a busy machine)."""
    run = _python(f"""
        import sys
        from tev_jax.cli import main
        try:
            code = main({argv!r})
        except SystemExit as e:
            code = e.code
        print("jax imported:", "jax" in sys.modules, "code:", code, file=sys.stderr)
        """)
    assert f"jax imported: False code: {code}" in run.stderr, run.stderr[-2000:]
    assert line in run.stdout + run.stderr


def test_a_far_typo_gets_no_suggestion():
    """Negative control: a flag like none of the subcommand's gets no 'did you mean'."""
    run = _python("""
        from tev_jax.cli import main
        main(["generate", "hello", "--zzzzzz", "1"])
        """)
    assert "unrecognized arguments: --zzzzzz 1" in run.stderr and "did you mean" not in run.stderr


def test_the_names_the_parser_offers_are_the_registries():
    """The command lines offer names without importing the registries (jax): they must
    stay equal to them."""
    from tev_jax import extensions
    from tev_jax.cli import flags
    from tev_jax.cli import plan as plan_cli
    from tev_jax.costs import plan

    assert flags.VERIFIER_NAMES == tuple(extensions.VERIFIERS)
    assert flags.BUILDER_NAMES == tuple(extensions.BUILDERS)
    assert plan_cli.PRESET_NAMES == tuple(sorted(plan.PRESETS))
    assert plan_cli.PROGRAMS_TO_PLAN == plan.DECODE_PROGRAMS


@pytest.mark.parametrize("port", ["99999", "65536", "-1"])
def test_serve_refuses_a_port_outside_tcp(port, capsys):
    """``--port 99999`` used to print http://127.0.0.1:99999 and listen on 34463 (99999
    mod 65536)."""
    pytest.importorskip("uvicorn")
    from tev_jax.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", port])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("tev-jax serve: error: --port must be a TCP port") and port in err[0]


def test_serve_refuses_a_batch_that_does_not_fit_naming_its_flags(capsys):
    """Issue 59, item 1: before it listens the server checks, from shapes, that its
    largest slot program fits each device's free memory, and refuses in one line naming
    the flags to lower (here the cache of 4096 rows of 40 000 tokens); the negative
    control: the bundled default's memory check (the plan it would serve) passes."""
    pytest.importorskip("uvicorn")
    from tev_jax.cli import main
    from tev_jax.decode import DecodeConfig
    from tev_jax.models.bundled import load_bundled
    from tev_jax.server.run import check_fits

    with pytest.raises(SystemExit) as e:
        main(["serve", "--max-batch", "4096", "--max-tokens", "20000",
              "--max-prompt-tokens", "20000", "--port", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("tev-jax serve: error: not enough memory")
    assert "lower --max-tokens (20000), --max-prompt-tokens or --max-batch" in err[-1]
    target, drafter, _ = load_bundled()
    check_fits(target, drafter, DecodeConfig(max_new_tokens=256, prompt_len=512), 8, None)


def test_port_0_binds_a_free_port_and_says_which():
    pytest.importorskip("uvicorn")
    from tev_jax.server.run import listening_socket, log_config

    with listening_socket("127.0.0.1", 0) as sock:
        host, port = sock.getsockname()
        assert host == "127.0.0.1" and 0 < port < 65536
        sock.listen(1)  # as uvicorn does
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            listening_socket("127.0.0.1", port).close()  # taken: refused, naming it
    streams = {h["stream"] for h in log_config()["handlers"].values()}
    assert streams == {"ext://sys.stderr"}  # the access log too (uvicorn: stdout)


EXIT_LATE = """
    import atexit, os, signal, time
    from tev_jax.runtime import signals

    def slow_cleanup():  # as jax's clear_backends: a second or more at the exit
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)

    atexit.register(slow_cleanup)
    with signals.handled_signals("prog"):
        print("work done", flush=True)
    if QUIET:
        signals.exit_quietly(75)
    raise SystemExit(75)
"""


def test_a_signal_while_the_interpreter_exits_ends_it_quietly_with_its_code():
    """A Ctrl-C during the exit's clean-up (issue 58, item 2: about 1 s after the first,
    while tev-train run saved and exited) ends the process with the command's own code
    and no traceback; the negative control without `exit_quietly` prints the traceback
    from inside the clean-up."""
    quiet = _python("QUIET = True\n" + textwrap.dedent(EXIT_LATE))
    assert (quiet.returncode, quiet.stdout) == (75, "work done\n"), quiet.stderr
    assert "Traceback" not in quiet.stderr and quiet.stderr == ""
    loud = _python("QUIET = False\n" + textwrap.dedent(EXIT_LATE))
    assert "Traceback" in loud.stderr and "KeyboardInterrupt" in loud.stderr


def test_the_executables_run_through_the_quiet_entry_point():
    """`tev-jax` and `tev-train` (the console scripts) and ``python -m`` of both use the
    entry points that install `exit_quietly`."""
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"tev-jax": "tev_jax.cli:run", "tev-train": "train.__main__:run"}
    assert "run()" in (ROOT / "tev_jax" / "cli" / "__main__.py").read_text()
    assert (ROOT / "train" / "__main__.py").read_text().rstrip().endswith("run()")


def test_a_signal_during_the_compile_stops_before_the_timed_run(monkeypatch):
    """`tev_jax.costs.timing.timed_generate` checks for a signal after its compile call:
    a Ctrl-C that came during the compile raises there, before the timed runs (before,
    `tev-jax generate` decoded again, printed the completion, then exited 130)."""
    from tev_jax.costs import timing
    from tev_jax.decode import DecodeConfig
    from tev_jax.models.bundled import load_bundled
    from tev_jax.runtime import signals

    target, drafter, tok = load_bundled()
    config = DecodeConfig(max_new_tokens=4, budget=4)
    runs = []
    real = timing.compiled_generate

    def counting(*a, **k):
        run = real(*a, **k)
        return lambda: runs.append(1) or run()

    monkeypatch.setattr(timing, "compiled_generate", counting)
    prompt = [tok.encode("Once upon a time").ids]
    timing.timed_generate(target, drafter, prompt, config, repeats=2)
    assert len(runs) == 2  # the control: without a signal both timed runs happen
    runs.clear()
    monkeypatch.setattr(timing, "compiled_generate", real)
    with signals.handled_signals("test"):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        with pytest.raises(KeyboardInterrupt):
            timing.timed_generate(target, drafter, prompt, config, repeats=2)


def test_flag_names_stay_out_of_paths():
    """`name_flags` writes a setting's name as its flag, but never inside a path: before,
    ``--tuning ./tuning.json`` holding a JSON array read "./tuning.--json must hold"."""
    from tev_jax.runtime.exit_codes import name_flags

    names = {"json": "--json", "tuning": "--tuning", "max_new_tokens": "--max-new-tokens"}
    assert name_flags("the tuning file ./tuning.json must hold a JSON object", names) == (
        "the tuning file ./tuning.json must hold a JSON object")
    assert name_flags("runs/json must exist; json must be set; max_new_tokens (256)",
                      names) == "runs/json must exist; --json must be set; --max-new-tokens (256)"


def test_rollouts_help_says_what_limit_0_means(capsys):
    """Issue 58, item 7: ``--limit 0`` writes every prompt; the help says so."""
    from train.__main__ import main as train_main

    with pytest.raises(SystemExit):
        train_main(["rollouts", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--limit LIMIT use only the first N prompts (0, the default: every prompt)" in help_text
