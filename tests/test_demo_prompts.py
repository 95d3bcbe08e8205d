"""Training prompts of the demo drafter (train/demo/prompts.py)."""

import pytest
from test_corpus import _fake_config, fake_data_dir  # noqa: F401  (fixture)

from tev_jax.data.tokenizer import ASSISTANT, format_chat, format_chat_turn
from train.demo import corpus, prompts as demo_prompts


def test_chat_prompt_is_the_user_turn_up_to_the_assistant_marker():
    doc = format_chat_turn("What is 2+2?", "4")
    assert demo_prompts.chat_prompt(doc) == format_chat("What is 2+2?")
    assert demo_prompts.chat_prompt("no template here") is None


def test_code_prompt_ends_with_a_definition_line():
    import numpy as np

    text = "import os\n\nX = 1\n\n\ndef first(a):\n    return a\n\nclass Second:\n    pass\n"
    seen = set()
    for seed in range(20):
        prompt = demo_prompts.code_prompt(text, np.random.default_rng(seed))
        assert prompt in text  # a contiguous cut
        last = prompt.rstrip("\n").splitlines()[-1]
        assert last.startswith(("def ", "class ")), prompt
        seen.add(last)
    assert seen == {"def first(a):", "class Second:"}
    assert demo_prompts.code_prompt("x = 1\n", np.random.default_rng(0)) is None


def test_question_prompt_stops_at_the_answer_marker():
    assert demo_prompts.question_prompt("Question: 1+1?\nAnswer: 2") == "Question: 1+1?\nAnswer: "
    assert demo_prompts.question_prompt("Problem: x?\nSolution: y") == "Problem: x?\nSolution: "
    assert demo_prompts.question_prompt("no marker") is None


def test_training_prompts_come_from_the_train_split_only(fake_data_dir):  # noqa: F811
    config = _fake_config(fake_data_dir)
    docs = {d.id: d for d in corpus.build_documents(config)}
    records = demo_prompts.training_prompts(config, 60, seed=0)
    assert len(records) == 60
    assert {r["domain"] for r in records} == {"prose", "code", "gsm", "math", "chat"}
    for r in records:
        doc = docs[r["doc"]]
        assert doc.split == "train" and doc.domain == r["domain"]
        if r["domain"] == "chat":
            assert r["prompt"].endswith(ASSISTANT + "\n")
        else:
            assert r["prompt"] in doc.text
    assert len({r["doc"] for r in records}) == 60  # drawn without replacement
    assert records == demo_prompts.training_prompts(config, 60, seed=0)
    with pytest.raises(ValueError, match="only"):
        demo_prompts.training_prompts(config, 10_000)
