"""The server's request checks and text handling (`tev_jax.server.requests`, the pure
parts of `tev_jax.server.scheduler`): no engine, no HTTP, fast tier."""

import json

import pytest

from tev_jax.budget import AutoBudget
from tev_jax.decode import DecodeConfig
from tev_jax.sampling import PER_ROW, Sampling
from tev_jax.server.requests import (Limits, RequestError, error_body, held_back,
                                     parse_request, read_json, stop_at)
from tev_jax.server.detokenize import next_text
from tev_jax.server.scheduler import budget_of
from tev_jax.slots import serving_configs

V = 50  # the vocabulary: encode below gives ids in [0, 50)
LIMITS = Limits(model="m", prompt_len=8, max_tokens=32, max_positions=40, vocab_size=V,
                max_n=2)


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
    limits = Limits(model="m", prompt_len=32, max_tokens=32, max_positions=40, vocab_size=V)
    messages = [{"role": "user", "content": "hi"}]
    r = parse_request({"model": "m", "messages": messages}, limits, encode,
                      chat_format=chat_format)
    assert r.chat and r.prompt_ids == tuple(encode("<user>hi<assistant>"))
    assert r.max_tokens == 40 - 19  # by default, the rest of the context
    r = parse_request({"model": "m", "messages": messages, "max_completion_tokens": 3},
                      limits, encode, chat_format=chat_format)
    assert r.max_tokens == 3


@pytest.mark.parametrize("param, body", [
    ("model", {"model": None, "prompt": "a"}),
    ("model", {"model": ["m"], "prompt": "a"}),
    ("max_tokens", {"prompt": "a", "max_tokens": -1}),
    ("max_tokens", {"prompt": "a", "max_tokens": 0}),
    ("max_tokens", {"prompt": "a", "max_tokens": 33}),
    ("max_tokens", {"prompt": "a", "max_tokens": 2.5}),
    ("prompt", {"prompt": "a" * 9}),           # longer than the cache's prompt part
    ("prompt", {"prompt": ["a", "b"]}),         # several prompts: n = 1 only
    ("prompt", {"prompt": ""}),
    ("prompt", {}),
    ("n", {"prompt": "a", "n": 0}),
    ("n", {"prompt": "a", "n": 3}),             # more choices than the server's rows
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


def test_ignore_eos_is_honoured_not_refused():
    """vLLM's ``ignore_eos`` (which GuideLLM sends to fix output lengths) is parsed into
    the request (the scheduler gives the row ``stops=False``); a non-boolean is 400."""
    r = parse_request({"model": "m", "prompt": "a", "ignore_eos": True}, LIMITS, encode)
    assert r.ignore_eos and not parse_request({"model": "m", "prompt": "a"}, LIMITS,
                                              encode).ignore_eos
    refused("ignore_eos", prompt="a", ignore_eos="yes")


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
    limits = Limits(model="m", prompt_len=8, max_tokens=32, max_positions=10, vocab_size=V)
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
    assert next_text([0], lambda ids: "a\ufffd" if ids else "", [], final=False) == ("a", False)


def test_serving_configs_share_one_cache_follow_the_tuning_and_sample_per_row():
    base = DecodeConfig(max_new_tokens=16, prompt_len=16, budget=8)
    fixed = serving_configs(base, 4)
    assert {c.sampling for c in fixed.values()} == {PER_ROW}
    assert sorted(fixed) == [1, 2, 4] and {budget_of(c) for c in fixed.values()} == {8}
    auto = AutoBudget(table=((1, 16), (2, 8), (4, 0)))
    configs = serving_configs(DecodeConfig(max_new_tokens=16, prompt_len=16, budget=auto), 4)
    assert {s: budget_of(c) for s, c in configs.items()} == {1: 16, 2: 8, 4: 0}
    assert len({c.max_cache_len for c in configs.values()}) == 1
    ar = serving_configs(DecodeConfig(max_new_tokens=16, prompt_len=16, builder="none"), 2)
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


# ---------------------------------------------------------------- issue 57: trust


def strict_encode(text):
    """As the tokenizer does: a lone surrogate is not text (tokenizers raises TypeError)."""
    text.encode("utf-8")  # UnicodeEncodeError on a lone surrogate
    return encode(text)


@pytest.mark.parametrize("prompt", [
    [1, 1099511627776],  # past int32 and int64's reach of the vocabulary
    [1, 99999], [1, V], [-5, 10], [1, True], [1, 2.0], [[1, 2 ** 70]], [1, None],
])
def test_prompt_token_ids_must_lie_in_the_vocabulary(prompt):
    message = refused("prompt", prompt=prompt)
    assert f"[0, {V})" in message or "non-empty string" in message


def test_a_top_k_of_the_whole_vocabulary_is_off():
    """k >= V keeps every token: the setting without top-k (one lane, not one per k)."""
    assert parse(prompt="a", top_k=V).sampling == Sampling(1.0)
    assert parse(prompt="a", top_k=10 ** 30).sampling == Sampling(1.0)
    assert parse(prompt="a", top_k=V - 1).sampling == Sampling(1.0, top_k=V - 1)


def test_prompt_token_ids_in_the_vocabulary_pass():
    assert parse(prompt=[0, V - 1]).prompt_ids == (0, V - 1)
    assert parse(prompt=[[3, 4]]).prompt_ids == (3, 4)  # one prompt of token ids


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 0.5), ("presence_penalty", -1), ("presence_penalty", True),
    ("frequency_penalty", 0.1), ("frequency_penalty", False),
    ("logit_bias", {"5": 100}), ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {}}),
    ("min_tokens", 3), ("repetition_penalty", 1.2),
    ("repetition_penalty", True),
    ("logprobs", 1), ("logprobs", True), ("logprobs", 0), ("logprobs", 5),
    ("top_logprobs", 2), ("best_of", 2), ("best_of", True), ("suffix", "}"),
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "required"), ("functions", [{"name": "f"}]), ("function_call", "f"),
    ("stop_token_ids", [7]), ("min_p", 0.1), ("use_beam_search", True),
    ("length_penalty", 2), ("include_stop_str_in_output", True),
    ("skip_special_tokens", False), ("truncate_prompt_tokens", 4),
    ("prompt_logprobs", 1), ("allowed_token_ids", [1, 2]), ("bad_words", ["x"]),
    ("guided_json", {}), ("guided_regex", "a+"), ("guided_choice", ["a"]),
    ("structured_outputs", {"regex": "a"}), ("logits_processors", ["x"]),
    ("add_special_tokens", False), ("return_tokens_as_token_ids", True),
    ("reasoning_effort", "high"), ("modalities", ["text", "audio"]),
])
def test_output_changing_fields_are_refused_not_ignored(field, value):
    """Each is named (param = the field) and said to be unsupported; `True == 1` and
    `False == 0` in Python, so booleans never pass for numbers."""
    message = refused(field, prompt="a", **{field: value})
    assert "not supported by this server" in message


@pytest.mark.parametrize("field, value", [
    ("logprobs", True), ("logprobs", 1), ("top_logprobs", 0), ("top_logprobs", 3),
    ("echo", True), ("add_generation_prompt", False), ("continue_final_message", True),
    ("chat_template", "{{ messages }}"), ("chat_template_kwargs", {"enable_thinking": True}),
    ("add_special_tokens", True), ("documents", [{"text": "x"}]), ("response_format",
                                                                   {"type": "json_object"}),
])
def test_chat_output_changing_fields_are_refused(field, value):
    message = refused(field, chat=True, messages=[{"role": "user", "content": "a"}],
                      **{field: value})
    assert "not supported by this server" in message


def test_echo_with_logprobs_is_refused():
    refused("logprobs", prompt="a", echo=True, logprobs=1)
    assert parse(prompt="a", echo=True).echo


def test_neutral_values_and_metadata_pass():
    """No-op values of the refused fields, and fields that change nothing, are taken."""
    neutral = dict(presence_penalty=0, frequency_penalty=0.0, logit_bias={},
                   response_format={"type": "text"}, ignore_eos=False, min_tokens=0,
                   repetition_penalty=1, logprobs=None, best_of=1, tools=[],
                   tool_choice="none", suffix=None, stop_token_ids=[], top_logprobs=0,
                   skip_special_tokens=True, user="u-1", seed=5, n=1, metadata={"a": "b"},
                   store=False, parallel_tool_calls=True, stream_options={"include_usage": True},
                   service_tier="auto", max_completion_tokens=3)
    r = parse(prompt="abc", **neutral)
    assert r.prompt_ids == (47, 48, 49) and r.max_tokens == 3 and r.seed == 5
    assert parse(prompt="a", logprobs=False).prompt_ids == (47,)
    limits = Limits(model="m", prompt_len=32, max_tokens=32, max_positions=40, vocab_size=V)
    r = parse_request({"model": "m", "messages": [{"role": "user", "content": "a"}],
                       "logprobs": False, "top_logprobs": None, "echo": False,
                       "add_generation_prompt": True, "presence_penalty": None,
                       "max_completion_tokens": None, "max_tokens": 4}, limits, encode,
                      chat_format=chat_format)
    assert r.max_tokens == 4  # a null max_completion_tokens does not hide max_tokens


def test_per_request_speculative_decoding_in_vllms_shape():
    """vLLM's ``metrics.speculative_decoding`` from a request's choices' last events
    (the histogram summed, dense from 0), and only when the server is asked for it."""
    from tev_jax.server.app import spec_decoding
    from tev_jax.server.scheduler import Event

    last = {0: Event("", "length", 3, 9, accepted=(2, 1, 0, 3), draft_tokens=36),
            1: Event("", "stop", 3, 4, accepted=(1, 1), draft_tokens=12)}
    assert spec_decoding(last) == {
        "mean_acceptance_length": 1 + 11 / 8, "draft_acceptance_rate": 11 / 48,
        "acceptance_histogram": [3, 2, 0, 3], "num_spec_steps": 8,
        "num_accepted_draft_tokens": 11, "num_draft_tokens": 48, "num_spec_tokens": 6}
    ar = spec_decoding({0: Event("", "length", 3, 9)})  # no tree round
    assert ar["num_spec_steps"] == 0 and ar["mean_acceptance_length"] is None
    for on in (True, False):
        client, _ = app_client(spec_metrics=on)
        body = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2]}).json()
        assert ("metrics" in body) == on, body


def test_types_and_sizes_of_what_is_read():
    refused("stream_options", prompt="a", stream_options={"include_usage": 1})
    refused("stream_options", prompt="a", stream_options={"continuous_usage_stats": "yes"})
    r = parse_request({"model": "m", "prompt": "a", "stream": True,
                       "stream_options": {"continuous_usage_stats": True}}, LIMITS, encode)
    assert r.continuous_usage and not r.include_usage  # vLLM's: usage in every chunk
    refused("stream_options", prompt="a", stream_options=[])
    refused("stop", prompt="a", stop="x" * 1001)
    refused("stop", prompt="a", stop=[1])
    refused("return_token_ids", prompt="a", return_token_ids=1)
    refused("echo", prompt="a", echo=1)
    refused("n", prompt="a", n=True)
    refused("max_completion_tokens", prompt="a", max_completion_tokens=True)
    refused("seed", prompt="a", seed=True)
    # a large value is not quoted whole in the message
    assert len(refused("temperature", prompt="a", temperature="x" * 100000)) < 200


def test_lone_surrogates_are_refused_naming_the_field():
    """``"\\ud800"`` in the JSON is a str the tokenizer raises TypeError on."""
    body = read_json(b'{"model": "m", "prompt": "\\ud800 abc"}')
    with pytest.raises(RequestError) as e:
        parse_request(body, LIMITS, strict_encode)
    assert e.value.param == "prompt" and e.value.status == 400
    json.dumps(error_body(e.value), ensure_ascii=False).encode("utf-8")  # encodes
    for chat, extra, param in [
        (True, {"messages": [{"role": "user", "content": "a\udc00"}]}, "messages"),
        (True, {"messages": [{"role": "user", "content": [{"type": "text",
                                                          "text": "\ud83d"}]}]}, "messages"),
        (False, {"prompt": "a", "stop": ["\ud800"]}, "stop"),
    ]:
        with pytest.raises(RequestError) as e:
            parse_request({"model": "m", **extra}, LIMITS, strict_encode,
                          chat_format=chat_format if chat else None)
        assert e.value.param == param, extra
    # a wrong model with a surrogate: 404 whose body still encodes
    with pytest.raises(RequestError) as e:
        parse_request({"model": "\ud800", "prompt": "a"}, LIMITS, strict_encode)
    json.dumps(error_body(e.value), ensure_ascii=False).encode("utf-8")


def test_a_wrong_model_is_404_model_not_found():
    with pytest.raises(RequestError) as e:
        parse(model="gpt-4", prompt="a")
    assert e.value.status == 404 and e.value.param == "model"
    assert error_body(e.value)["error"]["code"] == "model_not_found"


def test_bodies_that_are_not_json_objects_are_400():
    for body in (b"[" * 100000 + b"]" * 100000, b'{"a": NaN}', b'{"a": Infinity}',
                 b'{"a": ' + b"9" * 5000 + b"}", b"\xed\xa0\x80", b""):
        with pytest.raises(RequestError) as e:
            read_json(body)
        assert e.value.status == 400 and e.value.param is None, body[:20]


def test_chat_content_parts_and_system_roles_reach_the_template():
    seen = []

    def template(messages):
        seen.append(messages)
        return chat_format(messages)

    limits = Limits(model="m", prompt_len=64, max_tokens=8, max_positions=80, vocab_size=V)
    messages = [{"role": "system", "content": "S"}, {"role": "developer", "content": "D"},
                {"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}], "name": "x"}]
    parse_request({"model": "m", "messages": messages}, limits, encode, chat_format=template)
    assert seen[-1] == [{"role": "system", "content": "S"},
                        {"role": "developer", "content": "D"},
                        {"role": "user", "content": "a\nb", "name": "x"}]
    # one text part equals the string
    one = parse_request({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, limits, encode,
        chat_format=template)
    assert one.prompt_ids == parse_request({"model": "m", "messages": [
        {"role": "user", "content": "hi"}]}, limits, encode, chat_format=template).prompt_ids
    for bad in ([{"type": "image_url", "image_url": {"url": "http://x"}}],
                [{"type": "text"}], [], [3], {"type": "text", "text": "a"}, None):
        refused("messages", chat=True, messages=[{"role": "user", "content": bad}])
    refused("messages", chat=True, messages=[{"role": "tool", "content": "r",
                                              "tool_call_id": "1"}])
    refused("messages", chat=True, messages=[
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}])
    refused("messages", chat=True, messages=[{"role": "user", "content": "a", "name": 5}])
    refused("messages", chat=True, messages=["hi"])


def test_a_template_error_is_a_400_naming_messages():
    def broken(messages):
        raise TypeError("'NoneType' object is not iterable")

    with pytest.raises(RequestError) as e:
        parse_request({"model": "m", "messages": [{"role": "user", "content": "a"}]},
                      LIMITS, encode, chat_format=broken)
    assert e.value.param == "messages" and e.value.status == 400


def test_chat_formatter_reads_chat_template_jinja_and_maps_developer(tmp_path):
    from tev_jax import text_io

    jinja = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
             "{% if add_generation_prompt %}[assistant]{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    (tmp_path / "chat_template.jinja").write_text(jinja)
    msgs = [{"role": "developer", "content": "D"}, {"role": "user", "content": "u"}]
    assert text_io.chat_formatter(tmp_path)(msgs) == "[system]D[user]u[assistant]"
    # the file wins over the config's field; a template that names developer gets it
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "old"}))
    assert text_io.chat_formatter(str(tmp_path))(msgs) == "[system]D[user]u[assistant]"
    knows = "{# developer #}" + jinja
    assert text_io.chat_formatter(None, knows)(msgs) == "[developer]D[user]u[assistant]"
    assert text_io.chat_formatter({"chat_template": "old"}, jinja)(msgs[1:]) == \
        "[user]u[assistant]"
    (tmp_path / "chat_template.jinja").unlink()
    assert text_io.chat_formatter(tmp_path)(msgs) == "old"


def test_the_bundled_template_takes_a_system_turn_and_keeps_one_user_turn():
    from tev_jax import text_io
    from tev_jax.data.tokenizer import format_chat

    # byte-identical to what the bundled drafters were trained on
    assert format_chat("What is 2?") == "<|user|>\nWhat is 2?<|end|>\n<|assistant|>\n"
    chat = text_io.chat_formatter(None)
    assert chat([{"role": "user", "content": "What is 2?"}]) == format_chat("What is 2?")
    with_system = chat([{"role": "system", "content": "Be brief."},
                        {"role": "developer", "content": "Use digits."},
                        {"role": "user", "content": "What is 2?"}])
    assert with_system == ("<|user|>\nBe brief.\n\nUse digits.\n\nWhat is 2?<|end|>\n"
                           "<|assistant|>\n")
    with pytest.raises(ValueError, match="one user turn"):
        chat([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    with pytest.raises(ValueError, match="one user turn"):
        chat([{"role": "system", "content": "b"}])


# ------------------------------------------------- the app over a scheduler stand-in


class FakeScheduler:
    """Answers every request at once with one event ("ok"); remembers what it got."""

    def __init__(self):
        from tev_jax.server.scheduler import Event

        self.Event, self.submitted, self.draining = Event, [], False

    def start(self):
        return self

    def drain(self, seconds=0.0):
        self.draining = True

    def join(self, timeout=None):
        return True

    def snapshot(self):
        return {"draining": self.draining, "live": 0, "waiting": 0, "finish_reasons": {}}

    def submit(self, request, emit):
        from tev_jax.server.scheduler import Draining

        if self.draining:
            raise Draining("the server is shutting down")
        self.submitted.append(request)
        for i in range(request.n):
            emit(self.Event("ok", "stop", len(request.prompt_ids), 1, (7,), i))
        return [type("Job", (), {"cancel": lambda self: None})()] * request.n


def app_client(encode_fn=strict_encode, **served):
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from tev_jax.server.app import Served, create_app

    scheduler = FakeScheduler()
    s = Served(scheduler, LIMITS, encode_fn, chat_format, **served)
    return TestClient(create_app(s), raise_server_exceptions=False), scheduler


def assert_openai_error(r, status, code=None, param=None):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == code and error["param"] == param, error
    return error


def test_app_answers_every_failure_with_openai_json():
    client, scheduler = app_client()
    assert_openai_error(client.get("/nope"), 404, "not_found")
    assert_openai_error(client.get("/v1/completions"), 405, "method_not_allowed")
    assert_openai_error(client.post("/health"), 405, "method_not_allowed")
    assert client.get("/v1/models/m").json()["id"] == "m"
    assert_openai_error(client.get("/v1/models/gpt-4"), 404, "model_not_found", "model")
    assert_openai_error(client.post("/v1/completions", json={"model": "gpt-4", "prompt": "a"}),
                        404, "model_not_found", "model")
    assert_openai_error(client.post("/v1/completions", content=b"{bad"), 400)
    deep = b'{"model": "m", "prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    assert_openai_error(client.post("/v1/completions", content=deep), 400)
    surrogate = b'{"model": "m", "prompt": "\\ud800 abc", "max_tokens": 2}'
    assert_openai_error(client.post("/v1/completions", content=surrogate), 400, None, "prompt")
    poisoned = {"model": "m", "prompt": [1, 1099511627776]}
    assert_openai_error(client.post("/v1/completions", json=poisoned), 400, None, "prompt")
    assert not scheduler.submitted  # nothing above reached the scheduler
    r = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
    assert scheduler.submitted[-1].prompt_ids == (1, 2)
    r = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "n": 2}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]  # n choices, the prompt counted once
    assert r["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    chunks = [json.loads(line[6:]) for line in client.post(
        "/v1/completions", json={"model": "m", "prompt": [1, 2], "n": 2, "stream": True,
                                 "stream_options": {"include_usage": True}}
    ).text.splitlines() if line.startswith("data: {")]
    assert sorted({c["choices"][0]["index"] for c in chunks if c["choices"]}) == [0, 1]
    assert chunks[-1]["usage"]["completion_tokens"] == 2
    chunks = [json.loads(line[6:]) for line in client.post(
        "/v1/completions", json={"model": "m", "prompt": [1, 2], "n": 2, "stream": True,
                                 "stream_options": {"continuous_usage_stats": True}}
    ).text.splitlines() if line.startswith("data: {")]
    assert [c["usage"]["completion_tokens"] for c in chunks if c["choices"]] == [1, 2]


def test_app_turns_an_unexpected_error_into_500_json():
    def broken(text):
        raise RuntimeError("boom")

    client, _ = app_client(broken)
    error = assert_openai_error(client.post("/v1/completions", json={"model": "m",
                                                                     "prompt": "a"}), 400,
                                None, "prompt")
    assert "RuntimeError" in error["message"]

    def crash(*a, **k):
        raise KeyError("x")

    import tev_jax.server.app as app_module

    client, _ = app_client()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(app_module, "parse_request", crash)
        error = assert_openai_error(client.post("/v1/completions", json={"model": "m"}), 500)
    assert error["type"] == "server_error"


def test_app_refuses_a_large_body_before_reading_it():
    client, _ = app_client(max_body_bytes=1000)
    body = json.dumps({"model": "m", "prompt": "a" * 2000}).encode()
    error = assert_openai_error(client.post("/v1/completions", content=body), 413,
                                "request_too_large")
    assert "1000" in error["message"]

    def chunks():  # no Content-Length: counted while read
        for _ in range(10):
            yield b" " * 500

    assert_openai_error(client.post("/v1/completions", content=chunks()), 413,
                        "request_too_large")
    r = client.post("/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": 1})
    assert r.status_code == 200


def test_api_key_guards_v1_and_leaves_health_open():
    client, _ = app_client(api_key="s3cret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                    {"Authorization": "Basic s3cret"}):
        error = assert_openai_error(client.get("/v1/models", headers=headers), 401,
                                    "invalid_api_key")
        assert error["type"] == "invalid_request_error"
        assert_openai_error(client.post("/v1/completions", headers=headers,
                                        json={"model": "m", "prompt": "a"}), 401,
                            "invalid_api_key")
    ok = {"Authorization": "Bearer s3cret"}
    assert client.get("/v1/models", headers=ok).status_code == 200
    assert client.post("/v1/completions", headers=ok,
                       json={"model": "m", "prompt": "a", "max_tokens": 1}).status_code == 200
    assert client.get("/health").status_code == 200


def test_health_says_draining_and_requests_get_503():
    client, scheduler = app_client()
    scheduler.drain()
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "draining"
    error = assert_openai_error(client.post("/v1/completions", json={
        "model": "m", "prompt": "a", "max_tokens": 1}), 503)
    assert error["type"] == "server_error"


def test_serve_takes_the_api_key_from_the_flag_or_the_environment(monkeypatch):
    pytest.importorskip("uvicorn")
    from tev_jax import cli
    from tev_jax.server import run

    got = []
    monkeypatch.setattr(run, "serve", lambda options: got.append(options) or 0)
    monkeypatch.setenv("TEV_JAX_API_KEY", "from-env")
    assert cli.main(["serve", "--max-body-mb", "2"]) == 0
    assert got[-1].api_key == "from-env" and got[-1].max_body_bytes == 2 * 2**20
    assert cli.main(["serve", "--api-key", "flag"]) == 0 and got[-1].api_key == "flag"
    monkeypatch.delenv("TEV_JAX_API_KEY")
    assert cli.main(["serve"]) == 0 and got[-1].api_key is None
    assert got[-1].max_body_bytes == 8 * 2**20
