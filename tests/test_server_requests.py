"""The server's request checks and text handling (`tev_jax.server.requests`, the pure
parts of `tev_jax.server.scheduler`): no engine, no HTTP, fast tier."""

import json

import pytest

from tev_jax.budget import AutoBudget
from tev_jax.decode import DecodeConfig
from tev_jax.sampling import Sampling
from tev_jax.server.requests import (Limits, RequestError, error_body, held_back,
                                     parse_request, read_json, stop_at)
from tev_jax.server.scheduler import budget_of, lane_configs, next_text

LIMITS = Limits(model="m", prompt_len=8, max_tokens=32, max_positions=40)


def encode(text):
    return [ord(c) % 50 for c in text]


def chat_format(messages):
    return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def parse(chat=False, **body):
    return parse_request({"model": "m", **body}, LIMITS, encode,
                         chat_format=chat_format if chat else None)


def refused(param, chat=False, **body):
    with pytest.raises(RequestError) as e:
        parse(chat=chat, **body)
    assert e.value.param == param and e.value.status == 400
    assert error_body(e.value)["error"]["param"] == param
    return e.value.message


def test_completion_fields_become_a_typed_request():
    r = parse(prompt="abc", max_tokens=5, temperature=0.5, top_p=0.9, top_k=7, seed=3,
              stop=["x", "yz"], stream=True, stream_options={"include_usage": True})
    assert r.prompt_ids == (47, 48, 49) and r.max_tokens == 5 and not r.chat
    assert r.sampling == Sampling(temperature=0.5, top_k=7, top_p=0.9)
    assert r.stop == ("x", "yz") and r.stream and r.include_usage and r.seed == 3
    # OpenAI's defaults: temperature 1, 16 tokens for completions, the server's M for chat
    assert parse(prompt="a").sampling == Sampling(1.0) and parse(prompt="a").max_tokens == 16
    assert parse(prompt=[5, 6]).prompt_ids == (5, 6)
    assert parse(prompt=["ab"]).prompt_ids == (47, 48)
    # temperature 0 is greedy whatever top_p / top_k say (one lane for all greedy requests)
    assert parse(prompt="a", temperature=0, top_p=0.5, top_k=3).sampling == Sampling(0.0)
    assert parse(prompt="a", temperature=1, top_p=1, top_k=-1).sampling == Sampling(1.0)


def test_chat_applies_the_template():
    limits = Limits(model="m", prompt_len=32, max_tokens=32, max_positions=40)
    messages = [{"role": "user", "content": "hi"}]
    r = parse_request({"model": "m", "messages": messages}, limits, encode,
                      chat_format=chat_format)
    assert r.chat and r.prompt_ids == tuple(encode("<user>hi<assistant>"))
    assert r.max_tokens == 40 - 19  # by default, the rest of the context
    r = parse_request({"model": "m", "messages": messages, "max_completion_tokens": 3},
                      limits, encode, chat_format=chat_format)
    assert r.max_tokens == 3


@pytest.mark.parametrize("param, body", [
    ("model", {"model": "other", "prompt": "a"}),
    ("max_tokens", {"prompt": "a", "max_tokens": -1}),
    ("max_tokens", {"prompt": "a", "max_tokens": 0}),
    ("max_tokens", {"prompt": "a", "max_tokens": 33}),
    ("max_tokens", {"prompt": "a", "max_tokens": 2.5}),
    ("prompt", {"prompt": "a" * 9}),           # longer than the cache's prompt part
    ("prompt", {"prompt": ["a", "b"]}),         # several prompts: n = 1 only
    ("prompt", {"prompt": ""}),
    ("prompt", {}),
    ("n", {"prompt": "a", "n": 2}),
    ("temperature", {"prompt": "a", "temperature": -0.1}),
    ("temperature", {"prompt": "a", "temperature": "hot"}),
    ("top_p", {"prompt": "a", "top_p": 0}),
    ("top_k", {"prompt": "a", "top_k": 0}),
    ("stop", {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}),
    ("stop", {"prompt": "a", "stop": [""]}),
    ("seed", {"prompt": "a", "seed": "x"}),
    ("seed", {"prompt": "a", "seed": 2**64}),
    ("stream", {"prompt": "a", "stream": "yes"}),
    ("logprobs", {"prompt": "a", "logprobs": 3}),
])
def test_bad_fields_are_named(param, body):
    refused(param, **body)


def test_request_keys_use_all_64_bits_of_a_seed():
    """A seed's row key (`tev_jax.server.scheduler.request_keys`) tells apart seeds that
    agree in their low or high 32 bits, and takes a negative seed modulo 2**64."""
    import jax

    from tev_jax.server.scheduler import request_keys

    seeds = [0, 1, 2**32, 2**32 + 1, 2**63, 2**64 - 1, -1]
    data = jax.random.key_data(request_keys(seeds)).reshape(len(seeds), -1).tolist()
    assert len({tuple(d) for d in data[:-1]}) == len(seeds) - 1
    assert data[-1] == data[-2]


def test_prompt_and_max_tokens_must_fit_the_context():
    limits = Limits(model="m", prompt_len=8, max_tokens=32, max_positions=10)
    with pytest.raises(RequestError) as e:
        parse_request({"model": "m", "prompt": "abcd", "max_tokens": 7}, limits, encode)
    assert e.value.param == "prompt" and "context" in e.value.message


def test_chat_messages_are_checked():
    assert refused("messages", chat=True, messages=[]) is not None
    refused("messages", chat=True, messages=[{"role": "user"}])
    refused("messages", chat=True, messages="hi")


def test_bad_json_is_refused():
    for body in (b"{bad", b"[1, 2]", b"\xff"):
        with pytest.raises(RequestError) as e:
            read_json(body)
        assert e.value.status == 400 and e.value.param is None
    assert read_json(json.dumps({"a": 1}).encode()) == {"a": 1}


def test_stop_strings_cut_and_hold_back():
    assert stop_at("hello world", ["wor", "lo"]) == 3
    assert stop_at("hello", ["x"]) is None
    assert held_back("the en", ["end"]) == 2      # 'en' may become 'end'
    assert held_back("the e", ["end", "xe"]) == 1
    assert held_back("tha", ["end"]) == 0
    decode = lambda ids: "".join(chr(97 + i) for i in ids)
    assert next_text([0, 1, 2], decode, ["c"], final=False) == ("ab", True)
    assert next_text([0, 1, 3], decode, ["de"], final=False) == ("ab", False)
    assert next_text([0, 1, 3], decode, ["de"], final=True) == ("abd", False)
    # a character whose bytes are not all generated yet waits
    assert next_text([0], lambda ids: "a\ufffd", [], final=False) == ("a", False)


def test_lane_configs_share_one_cache_and_follow_the_tuning():
    base = DecodeConfig(max_new_tokens=16, prompt_len=16, budget=8)
    fixed = lane_configs(base, 4)
    assert sorted(fixed) == [1, 2, 4] and {budget_of(c) for c in fixed.values()} == {8}
    auto = AutoBudget(table=((1, 16), (2, 8), (4, 0)))
    configs = lane_configs(DecodeConfig(max_new_tokens=16, prompt_len=16, budget=auto), 4)
    assert {s: budget_of(c) for s, c in configs.items()} == {1: 16, 2: 8, 4: 0}
    assert len({c.max_cache_len for c in configs.values()}) == 1
    ar = lane_configs(DecodeConfig(max_new_tokens=16, prompt_len=16, builder="none"), 2)
    assert {budget_of(c) for c in ar.values()} == {0}


def test_serve_without_the_extra_says_how_to_install_it(monkeypatch, capsys):
    import sys

    from tev_jax import cli

    for name in ("uvicorn", "tev_jax.server.run", "tev_jax.server.app"):
        monkeypatch.setitem(sys.modules, name, None)  # as if the serve extra were absent
    monkeypatch.delattr("tev_jax.server.run", raising=False)
    assert cli.main(["serve"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and 'pip install -e ".[serve]"' in err
