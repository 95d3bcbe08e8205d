"""What the two command lines print when they work: ``--version`` and help for every
flag, a line saying what a long command does before it does it, the generated text
(streamed on a terminal exactly as piped, no cut character at its end, the turns of a
chat) and the summary of a prompt the model ends at once. From issues 26, 38 and 47; a
tiny saved target decoding autoregressively (and once the bundled models), called
in-process.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
from cli_fixtures import (
    AR, CONFIG, PROMPT, prompts_file, word_target, word_tokenizer,
)
from cli_fixtures import target_dir  # noqa: F401  (a fixture)
from decode_fixtures import greedy_reference

from tev_jax import cli
from tev_jax.costs import plan
from tev_jax.models import save_target
from train import __main__ as train_cli


def test_version_and_help_for_every_flag(capsys, monkeypatch):
    """Issue 26, finding 17: --version on both command lines; every flag has help text
    (tev-jax's plan flags are the lead's); tev-train names itself and shows no reST."""
    import argparse

    for main, name in ((cli.main, "tev-jax"), (train_cli.main, "tev-train")):
        with pytest.raises(SystemExit) as e:
            main(["--version"])
        assert e.value.code == 0 and capsys.readouterr().out.startswith(name + " 0.")
    monkeypatch.setattr(sys, "argv", ["/usr/bin/tev-train"])
    parser = train_cli.build_parser()
    assert parser.prog == "tev-train" and "`" not in parser.format_help()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subs.choices.items():
        text = sub.format_help()
        assert "`" not in text, name
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help and not action.help.startswith("(default"), (name, action)
    main_parser = argparse.ArgumentParser()
    sub = main_parser.add_subparsers()
    for add in cli.subcommands():
        add(sub)
    for name, p in sub.choices.items():
        for action in p._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, (name, action.option_strings)


def test_long_commands_say_what_they_do_first(tmp_path, capsys, monkeypatch):
    """Issue 38, item 16: plan, tev-train plan, tune and compare print what they are doing
    before the long work (here replaced by a stand-in that stops them)."""
    import train.plan
    from tev_jax.costs import timing, tune

    def stop(*args, **kw):
        raise ValueError("stopped")

    monkeypatch.setattr(plan, "plan_decode_programs", stop)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(["plan", "--model", "qwen3-0.6b", "--layers", "1", "--programs", "prefill"])
    assert capsys.readouterr().err.startswith("compiling 1 program(s) (prefill) of qwen3-0.6b")
    monkeypatch.setattr(train.plan, "plan_step", stop)
    assert train_cli.main(["plan", "--target", "qwen3-0.6b", "--mesh-fsdp", "1"]) == 2
    assert capsys.readouterr().err.startswith("compiling one training step")
    monkeypatch.setattr(tune, "tune", stop)
    with pytest.raises(SystemExit):
        cli.main(["tune", "--prompts", str(prompts_file(tmp_path / "p.jsonl"))])
    assert "tuning 5 prompt(s): one decode round at budget 128" in capsys.readouterr().err

    def first_method(target, methods, prompts, on_method=None, **kw):
        on_method(0, methods[0][0])
        raise ValueError("stopped")

    monkeypatch.setattr(timing, "compare_methods", first_method)
    with pytest.raises(SystemExit):
        cli.main(["compare", "hi", "--max-new-tokens", "4"])
    assert "[1/3] AR (target alone): compiling 1 prompt(s)" in capsys.readouterr().err


def test_streams_to_a_terminal_exactly(target_dir, capsys, monkeypatch):  # noqa: F811
    """Issue 26, finding 16: on a terminal a "compiling ..." line comes first and the text
    is streamed round by round; what stdout holds at the end is what the piped run
    prints."""
    argv = ["generate", PROMPT, "--target", str(target_dir), *AR]
    assert cli.main(argv) == 0
    piped, piped_err = capsys.readouterr()
    assert piped_err.startswith("compiling the decode program")  # issue 38, item 16
    writes = []
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    real_write = sys.stdout.write
    monkeypatch.setattr(sys.stdout, "write", lambda s: (writes.append(s), real_write(s))[1])
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out == piped and len([w for w in writes if w.strip()]) > 1
    assert err.startswith("compiling the decode program") and "streamed" in err


def test_a_prompt_the_model_ends_at_once(tmp_path, capsys):
    """Issue 26, finding 10: a prompt whose first token is a stop token reports no tau
    (not "tau = nan"), single and batch."""
    first = greedy_reference(word_target(), [[5, 17, 3]], 1)[0][0]
    path = tmp_path / "stops"
    save_target(word_target(dataclasses.replace(CONFIG, eos_token_ids=(int(first),))), path,
                tokenizer=word_tokenizer())
    assert cli.main(["generate", PROMPT, "--target", str(path), *AR]) == 0
    err = capsys.readouterr().err
    assert "1 new token: the target ended the text at its first token" in err
    assert "nan" not in err
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": 1, "prompt_ids": [5, 17, 3]}) + "\n")
    assert cli.main(["generate", "--prompts", str(tmp_path / "p.jsonl"), "--output",
                     str(tmp_path / "o.jsonl"), "--target", str(path), *AR]) == 0
    err = capsys.readouterr().err
    assert "tau n/a (every prompt ended at its first token" in err and "None" not in err


def test_printed_text_drops_a_cut_character():
    """Issue 38, nit: the printed text does not end in a character whose UTF-8 bytes were
    cut off (by max-new-tokens): the byte-level bundled tokenizer, an emoji cut after 2
    bytes."""
    from tev_jax.cli.generate import text_of
    from tev_jax.models import load_tokenizer
    from tev_jax.models.bundled import bundled_paths

    tok = load_tokenizer(bundled_paths().target)
    ids = tok.encode("a \U0001F642 b", add_special_tokens=False).ids
    cut = next(k for k in range(len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    assert text_of(tok, ids[:cut]) == tok.decode(ids[:cut])[:-1]
    assert text_of(tok, ids) == tok.decode(ids) == "a \U0001F642 b"


@pytest.mark.slow  # the fast tier's time (README: under 10 minutes here), 2026-12-06
def test_chat_output_shows_the_turns(capsys):
    """Issue 47, item 13: --chat prints the turns, with no leading empty line."""
    assert cli.main(["generate", "What is 12 * 7?", "--chat", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("user: What is 12 * 7?\nassistant: ")
