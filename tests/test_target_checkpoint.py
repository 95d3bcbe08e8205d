"""Config parsing and checkpoint validation: every bad input is a ValueError naming it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tev_jax.models import ModelConfig, RopeScaling, init_target, load_target, save_target
from tev_jax.models.checkpoint_io import load_tokenizer

BASE = {
    "model_type": "llama", "vocab_size": 120, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}


def test_rope_spellings_4x_and_5x_agree():
    v4 = {**BASE, "rope_theta": 500000.0,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    v5 = {**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                      "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}}
    legacy = {**v4, "rope_scaling": {**v4["rope_scaling"], "type": "llama3"}}
    del legacy["rope_scaling"]["rope_type"]
    a, b, c = (ModelConfig.from_hf(d) for d in (v4, v5, legacy))
    assert a == b == c
    assert a.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert a.rope_theta == 500000.0
    assert hash(a) == hash(b)
    assert ModelConfig.from_hf(a.to_hf()) == a
    plain = ModelConfig.from_hf({**BASE, "rope_parameters": {"rope_type": "default",
                                                             "rope_theta": 1e6}})
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None
    assert ModelConfig.from_hf({**BASE, "rope_theta": 1e6}) == plain


def test_qwen3_fields():
    c = ModelConfig.from_hf({**BASE, "model_type": "qwen3", "tie_word_embeddings": True,
                             "eos_token_id": [3, 4]})
    assert c.qk_norm and c.tie_word_embeddings and c.eos_token_ids == (3, 4)
    assert not ModelConfig.from_hf(BASE).qk_norm


@pytest.mark.parametrize("change,needle", [
    ({"model_type": "mistral"}, "supported: qwen3, llama"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "supported: default, linear, llama3"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"use_sliding_window": True}, "sliding"),
    ({"num_key_value_heads": 3}, "num_kv_heads"),
])
def test_unsupported_config_is_a_clear_error(change, needle):
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_hf({**BASE, **change})


def test_missing_field_is_named():
    d = dict(BASE)
    del d["intermediate_size"]
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelConfig.from_hf(d)


@pytest.fixture()
def ckpt(tmp_path):
    model = init_target(ModelConfig.from_hf(BASE), key=0)
    save_target(model, tmp_path / "m")
    return tmp_path / "m"


def _rewrite(path, fn):
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def test_missing_tensor(ckpt):
    _rewrite(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_target(ckpt)


def test_extra_tensor(ckpt):
    _rewrite(ckpt, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.zeros((2, 2),
                                                                                    np.float32)}))
    with pytest.raises(ValueError, match=r"unexpected tensor.*model\.layers\.2\.mlp\.up_proj"):
        load_target(ckpt)


def test_wrong_shape(ckpt):
    _rewrite(ckpt, lambda t: t.update({"model.norm.weight": np.ones((31,), np.float32)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight: shape \(31,\), expected \(32,\)"):
        load_target(ckpt)


def test_unsupported_model_type_in_checkpoint(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        load_target(ckpt)


def test_corrupt_and_truncated_files(ckpt, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header!!!!")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_target(bad)
    data = (ckpt / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_target(bad)
    (bad / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_target(bad)


def test_sharded_index_pointing_at_missing_file(ckpt):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match="model-00002-of-00002"):
        load_target(ckpt)


def _word_tokenizer(n):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(n)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def test_tokenizer_and_vocab_check(ckpt):
    _word_tokenizer(100).save(str(ckpt / "tokenizer.json"))
    tok = load_tokenizer(ckpt)
    assert tok.encode("w3 w7").ids == [3, 7]
    load_target(ckpt)  # 100 <= vocab 120 (HF embeddings are often padded)
    _word_tokenizer(121).save(str(ckpt / "tokenizer.json"))
    with pytest.raises(ValueError, match="vocab_size"):
        load_target(ckpt)
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(ckpt / "nowhere")
