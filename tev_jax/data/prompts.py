"""Evaluation prompt sets bundled in ``tev_jax/data/prompts/`` (attribution in its README).

| set         | prompts | format                         | source                         |
|-------------|---------|--------------------------------|--------------------------------|
| ``mt_bench``  | 80      | first turn, chat template      | MT-Bench questions (Apache-2.0) |
| ``humaneval`` | 164     | the prompt as is (code)        | HumanEval (MIT)                |
| ``gsm``       | 128     | question, chat template        | gsm_eval (reasoning-gym, Apache-2.0) |
| ``math``      | 70      | problem, chat template         | CHAMP hold-out (MIT)           |

None of these records is in the training corpus (``corpus.build_documents`` never reads
the evaluation files, and drops the competition-math hold-out).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

from tev_jax.data.corpus import math_holdout_ids, read_jsonl, resolve_data_dir
from tev_jax.data.tokenizer import format_chat

PROMPT_SETS: tuple[str, ...] = ("mt_bench", "humaneval", "gsm", "math")
PROMPT_COUNTS: Mapping[str, int] = {"mt_bench": 80, "humaneval": 164, "gsm": 128, "math": 70}
_TEXT_FIELD = {"mt_bench": "turn", "humaneval": "prompt", "gsm": "question", "math": "problem"}
_CHAT = {"mt_bench": True, "humaneval": False, "gsm": True, "math": True}


def _check_name(name: str) -> None:
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {name!r}; choose one of {PROMPT_SETS}")


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


def export_prompt_records(data_dir: str | Path) -> dict[str, list[dict]]:
    """Builds the bundled prompt records from the shared data (what gets committed).

    Keeps only what the experiments need: MT-Bench first turns, HumanEval prompts and
    entry points, GSM eval questions with their final answers, and the held-out CHAMP
    problems with their solutions.
    """
    data_dir = resolve_data_dir(data_dir)
    mt_bench = [
        {"id": r["id"], "category": r["category"], "turn": r["turns"][0]}
        for r in read_jsonl(data_dir / "mt_bench.jsonl")
    ]
    humaneval = [
        {"id": r["id"], "prompt": r["prompt"], "entry_point": r["entry_point"]}
        for r in read_jsonl(data_dir / "humaneval.jsonl")
    ]
    gsm = []
    for r in read_jsonl(data_dir / "gsm_eval.jsonl"):
        if "####" not in r["answer"]:
            raise ValueError(f"{r['id']}: answer has no '#### <number>' line")
        gsm.append(
            {"id": r["id"], "question": r["question"],
             "answer": r["answer"].rsplit("####", 1)[1].strip()}
        )
    math_records = read_jsonl(data_dir / "math_champ.jsonl")
    held_out = math_holdout_ids(math_records)
    math = [
        {"id": r["id"], "problem": r["problem"], "solution": r["solution"]}
        for r in math_records
        if r["id"] in held_out
    ]
    sets = {"mt_bench": mt_bench, "humaneval": humaneval, "gsm": gsm, "math": math}
    for name, records in sets.items():
        if len(records) != PROMPT_COUNTS[name]:
            raise ValueError(f"{name}: {len(records)} records, expected {PROMPT_COUNTS[name]}")
    return sets


def write_prompt_records(sets: Mapping[str, list[dict]], out_dir: str | Path) -> None:
    """Writes one ``<set>.jsonl`` per prompt set (UTF-8, one record per line)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, records in sets.items():
        lines = [json.dumps(record, ensure_ascii=False) for record in records]
        (out_dir / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
