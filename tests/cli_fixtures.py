"""Tiny saved models and helpers shared by the tests that call the command lines
in-process (``tev_jax.cli.main``, ``train.__main__.main``).

The saved target (V = 64, a word-level tokenizer ``w0 .. w63``, a 64-token context)
decodes autoregressively (``AR``), so every program compiles in seconds. The refusal
checks state what a refused command prints: exit code 2 and one line naming the
mistake (a traceback or a usage block is a failure).
"""

from __future__ import annotations

import json

import pytest

from tev_jax import cli
from tev_jax.models import ModelConfig, init_target, save_target
from tev_jax.models.drafter_io import init_drafter, save_drafter
from train import __main__ as train_cli

V = 64
CONFIG = ModelConfig(model_type="qwen3", vocab_size=V, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                     max_position_embeddings=64)
PROMPT = "w5 w17 w3"
AR = ["--builder", "none", "--max-new-tokens", "4"]


def word_tokenizer():
    """A word-level tokenizer: ``w<i>`` is token i (unknown words are ``w0``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def word_target(cfg=CONFIG):
    """The tiny target (seed 8), its head scaled so that its logits are a trained LM's size."""
    target = init_target(cfg, key=8)
    target.lm_head[...] = target.lm_head[...] * 20.0
    return target


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A saved `word_target` with its tokenizer, alone in its folder."""
    path = tmp_path_factory.mktemp("models") / "target"
    save_target(word_target(), path, tokenizer=word_tokenizer())
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A folder holding ``target/`` (`word_target` and its tokenizer) and ``drafter/`` (a
    fresh 1-layer drafter of it, block size 3)."""
    root = tmp_path_factory.mktemp("models")
    target = word_target()
    save_target(target, root / "target", tokenizer=word_tokenizer())
    save_drafter(init_drafter(target, num_layers=1, block_size=3, mask_token_id=V - 1, key=1),
                 root / "drafter")
    return root


# ------------------------------------------------------------------- prompts and jobs


def mixed_prompts_file(path, n=5):
    """``n`` prompt_ids records ``q0 ..`` of 1 to 3 tokens (rows of different lengths)."""
    rows = [{"id": f"q{i}", "prompt_ids": [5 + i, 17, 3 + i][: 1 + i % 3]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prompts_file(path, n=5):
    """``n`` prompt_ids records ``q0 ..`` of 3 tokens each."""
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt_ids": [5 + i, 17, 3]}) + "\n"
                            for i in range(n)))
    return path


def batch_argv(target_dir, tmp_path, *extra):
    """``generate`` of a `mixed_prompts_file` (tmp_path/p.jsonl) into tmp_path/out.jsonl,
    autoregressively, 2 rows at a time."""
    return ["generate", "--prompts", str(mixed_prompts_file(tmp_path / "p.jsonl")),
            "--output", str(tmp_path / "out.jsonl"), "--target", str(target_dir), *AR,
            "--batch-size", "2", *extra]


def job_argv(model_dirs, tmp_path, *extra):
    """``generate`` of a `prompts_file` (tmp_path/p.jsonl) into tmp_path/out.jsonl with the
    target of `model_dirs`, autoregressively (the batch size left to the job)."""
    return ["generate", "--prompts", str(prompts_file(tmp_path / "p.jsonl")), "--output",
            str(tmp_path / "out.jsonl"), "--target", str(model_dirs / "target"), *AR, *extra]


def train_run_argv(root, out, *extra):
    """``tev-train run`` on the `train_fixtures.train_dirs` folder ``root``: 6 updates of the
    token loss, a checkpoint every 2."""
    return ["run", "--target-path", str(root / "target"), "--drafter-path",
            str(root / "drafter"), "--data-dir", str(root / "data"), "--out-dir", str(out),
            "--loss", "token", "--batch-size", "8", "--num-anchors", "2", "--steps", "6",
            "--lr", "0.01", "--warmup-steps", "0", "--checkpoint-every", "2", "--no-progress",
            *extra]


# ------------------------------------------------------------------------- refusals


def one_line(capsys, prog="tev-jax") -> str:
    """The one stderr line printed since the last read, which starts with ``prog``."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(prog), err
    return err[0]


def refused_last_line(argv, capsys) -> str:
    """The error line of a refused tev-jax command (exit code 2): its last stderr line,
    which names the tool."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("tev-jax")
    return err[-1]


def refused_one_line(argv, capsys) -> str:
    """The one stderr line of a refused tev-jax command (exit code 2, no usage lines):
    ``tev-jax SUBCOMMAND: error: ...``."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    line = one_line(capsys)
    assert line.startswith(f"tev-jax {argv[0]}: error: ")
    return line


def refused_message(argv, capsys) -> str:
    """All that a refused tev-jax command (exit code 2) printed to stderr since the last
    read, with no traceback (argparse's usage errors print a usage line first)."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return err


def train_refused_one_line(argv, capsys) -> str:
    """The one stderr line of a refused tev-train command (exit code 2)."""
    capsys.readouterr()
    assert train_cli.main(argv) == 2
    return one_line(capsys, "python -m train")


def nothing_but(folder, *names):
    """``folder`` holds exactly ``names`` (a refused run wrote nothing)."""
    assert sorted(p.name for p in folder.iterdir()) == sorted(names)
