"""Config parsing and checkpoint validation: every bad input is a ValueError naming it."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from tev_jax.models import (
    ModelConfig, RopeScaling, init_target, load_target, save_target, score,
)
from tev_jax.models.checkpoint_io import load_tokenizer, read_headers

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


# --------------------------------------------------------------- bfloat16 checkpoints


@pytest.fixture(scope="module")
def hf_bf16(tmp_path_factory):
    """(tiny Qwen3ForCausalLM in bfloat16, its save_pretrained directory)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
        tie_word_embeddings=False, initializer_range=0.1)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model = model.to(torch.bfloat16)
    path = tmp_path_factory.mktemp("hf_bf16")
    model.save_pretrained(path)
    return model, path


def _np(t):
    return t.detach().float().numpy()


def _torch_logits(model, tokens):
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def _logits(model, tokens):
    return np.asarray(nnx.jit(score)(model, jnp.asarray(tokens)))


def test_bfloat16_checkpoint_from_transformers(hf_bf16):
    """Published checkpoints are bfloat16: they load exactly, into bf16 or float32."""
    import torch
    import transformers

    hf, path = hf_bf16
    assert {i.dtype for i in read_headers(path).values()} == {"BF16"}
    tokens = np.random.default_rng(0).integers(0, 120, (2, 12)).astype(np.int32)
    # Reloaded rather than cast with .float(): a cast would keep RoPE's bf16 inv_freq.
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)

    model32 = load_target(path)
    np.testing.assert_array_equal(np.asarray(model32.embed_tokens[...]),
                                  _np(hf.model.embed_tokens.weight))
    ref32 = _torch_logits(hf32, tokens)
    np.testing.assert_allclose(_logits(model32, tokens), ref32, atol=1e-5, rtol=0)

    model16 = load_target(path, dtype=jnp.bfloat16)
    assert model16.layers.mlp.up_proj.kernel[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(model16.layers.mlp.up_proj.kernel[1].astype(jnp.float32)),
        _np(hf.model.layers[1].mlp.up_proj.weight).T)
    ours16, ref16 = _logits(model16, tokens), _torch_logits(hf16, tokens)
    # bf16 activations round differently in torch and XLA: each side is checked
    # against the float32 reference at bf16 tolerance, and against the other.
    scale = np.abs(ref32).max()
    for got in (ours16, ref16):
        assert np.abs(got - ref32).max() < 0.03 * scale
    assert np.abs(ours16 - ref16).max() < 0.05 * scale


def test_bfloat16_export_reads_back_in_transformers(hf_bf16, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf, path = hf_bf16
    save_target(load_target(path, dtype=jnp.bfloat16), tmp_path / "out")
    assert {i.dtype for i in read_headers(tmp_path / "out").values()} == {"BF16"}
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    want = hf.state_dict()
    for name, w in back.state_dict().items():
        assert w.dtype == want[name].dtype, name
        np.testing.assert_array_equal(_np(w), _np(want[name]),
                                      err_msg=name)


def test_reader_refuses_inconsistent_offsets(ckpt):
    """A header whose byte ranges disagree with the dtype and shape is corrupt."""
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["model.norm.weight"]["dtype"] = "BF16"
    raw = json.dumps(header).encode()
    f.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])
    with pytest.raises(ValueError, match=r"model\.safetensors.*model\.norm\.weight"):
        load_target(ckpt)
