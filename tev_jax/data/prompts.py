"""Evaluation prompt sets bundled in ``tev_jax/data/prompts/`` (attribution in its README).

| set         | prompts | format                         | source                         |
|-------------|---------|--------------------------------|--------------------------------|
| ``mt_bench``  | 80      | first turn, chat template      | MT-Bench questions (Apache-2.0) |
| ``humaneval`` | 164     | the prompt as is (code)        | HumanEval (MIT)                |
| ``gsm``       | 128     | question, chat template        | gsm_eval (reasoning-gym, Apache-2.0) |
| ``math``      | 70      | problem, chat template         | CHAMP hold-out (MIT)           |

None of these records is in the training corpus (``train.demo.corpus.build_documents`` never
reads the evaluation files, and drops the competition-math hold-out);
``train.demo.prepare_corpus`` exports these files from the shared data.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

from tev_jax.data.tokenizer import format_chat

PROMPT_SETS: tuple[str, ...] = ("mt_bench", "humaneval", "gsm", "math")
PROMPT_COUNTS: Mapping[str, int] = {"mt_bench": 80, "humaneval": 164, "gsm": 128, "math": 70}
_TEXT_FIELD = {"mt_bench": "turn", "humaneval": "prompt", "gsm": "question", "math": "problem"}
_CHAT = {"mt_bench": True, "humaneval": False, "gsm": True, "math": True}


def _check_name(name: str) -> None:
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {name!r}; choose one of {PROMPT_SETS}")


def read_jsonl(path: str | Path) -> list[dict]:
    """Reads a JSONL file into a list of dicts; a malformed line raises ``ValueError``."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number}: invalid JSON ({error})") from error
    return records


def prompts_dir() -> Path:
    """Folder of the bundled prompt files."""
    return Path(str(resources.files("tev_jax.data").joinpath("prompts")))


def prompt_records(name: str) -> list[dict]:
    """The bundled records of one set (ids and reference fields included)."""
    _check_name(name)
    return read_jsonl(prompts_dir() / f"{name}.jsonl")


def prompt_set(name: str) -> list[str]:
    """The prompts of one evaluation set, ready to encode (``encode`` adds BOS).

    Args:
      name: one of ``PROMPT_SETS``.

    Returns:
      Prompt strings in source order: chat-formatted for mt_bench, gsm and math; the
      HumanEval prompts unchanged.
    """
    texts = [record[_TEXT_FIELD[name]] for record in prompt_records(name)]
    return [format_chat(text) for text in texts] if _CHAT[name] else texts


def prompt_file_records(name: str) -> list[dict]:
    """One set in the prompts-file format of ``tev-jax generate --prompts`` and
    ``tev-train rollouts --prompts-file`` (`tev_jax.text_io.read_prompts`): its id
    and, for the chat sets, a one-turn ``messages`` (rendered with the target's chat
    template, which for the bundled target is `format_chat`), else the ``prompt`` text.
    """
    out = []
    for record in prompt_records(name):
        text = record[_TEXT_FIELD[name]]
        body = ({"messages": [{"role": "user", "content": text}]} if _CHAT[name]
                else {"prompt": text})
        out.append({"id": record["id"], **body})
    return out
