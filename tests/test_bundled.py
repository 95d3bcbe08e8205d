"""The bundled demo models: export (float32 or bfloat16, atomic, size-limited, pinned by SHA-256),
lookup, corruption detection, and `tev-jax generate` with and without explicit paths.

The models here are random ones of the shipped shapes with the project's tokenizer
(V = 4096), exported into a temporary bundle; the last test runs the real bundle inside
the package.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from decode_fixtures import greedy_reference
from drafter_fixtures import _numpy_build
from tev_jax import cli
from tev_jax.data import tokenizer as tok_lib
from tev_jax.models import Target, bundled, load_target, save_target, score
from tev_jax.models.checkpoint_io import read_headers
from tev_jax.models.drafter import Drafter
from tev_jax.models.drafter_io import drafter_config_for, load_drafter, save_drafter
from train.demo_models import DemoPlan
from train.export_bundled import PROBE_TEXT, export_bundle
from train.train_target import TargetTrainConfig

PROMPT = "def fibonacci(n):"


def _random_demo_models():
    """Random models shaped like the shipped ones (`train.train_target`,
    `train.demo_models`), so the real bundle's test reuses the CLI test's compilation."""
    cfg = TargetTrainConfig().model_config(tok_lib.load_default_tokenizer().get_vocab_size())
    rng = np.random.default_rng(0)
    target = _numpy_build(lambda: Target(cfg, rngs=nnx.Rngs(0)), rng, kernel_std=0.05,
                          norm_std=0.2)
    plan = DemoPlan()
    dcfg = drafter_config_for(cfg, num_layers=plan.drafter_layers, block_size=plan.block_size,
                              mask_token_id=tok_lib.MASK_ID)
    drafter = _numpy_build(lambda: Drafter(dcfg, rngs=nnx.Rngs(0)), rng, kernel_std=0.05,
                           norm_std=0.3)
    return target, drafter


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Float32 source checkpoints laid out like the training runs (logs next to them)."""
    root = tmp_path_factory.mktemp("runs")
    target, drafter = _random_demo_models()
    save_target(target, root / "target" / "hf", tokenizer=tok_lib.load_default_tokenizer())
    (root / "target" / "log.jsonl").write_text(
        json.dumps({"step": 10, "loss": 5.0}) + "\n"
        + json.dumps({"step": 20, "loss": 4.0, "val": {"code": 1.234, "prose": 4.567}}) + "\n")
    save_drafter(drafter, root / "ft" / "drafter")
    (root / "ft" / "config.json").write_text(json.dumps({"loss": "exit", "budget": 64,
                                                         "exit_lambda": 0.1}))
    return root / "target" / "hf", root / "ft" / "drafter", target, drafter


@pytest.fixture(scope="module")
def bundle(sources, tmp_path_factory):
    out = tmp_path_factory.mktemp("pkg") / "models"
    export_bundle(sources[0], sources[1], out, dtype=jnp.bfloat16)  # the lossy path
    return out


def _copy(bundle, tmp_path):
    return shutil.copytree(bundle, tmp_path / "models")


def _bf16(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _flat_params(module) -> dict:
    return {p: np.asarray(v.get_value())
            for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def test_export_round_trip(sources, bundle):
    src_t, src_d, target, drafter = sources
    paths = bundled.bundled_paths(bundle)
    for sub in paths:
        assert {h.dtype for h in read_headers(sub).values()} == {"BF16"}
    loaded = load_target(paths.target)
    loaded_d = load_drafter(paths.drafter, loaded)
    for original, got in ((target, loaded), (drafter, loaded_d)):
        want, have = _flat_params(original), _flat_params(got)
        assert want.keys() == have.keys()
        for p in want:
            np.testing.assert_array_equal(have[p], _bf16(want[p]), err_msg=str(p))

    tokens = np.asarray([tok_lib.load_default_tokenizer().encode(PROBE_TEXT).ids], np.int32)
    graphdef, params, rest = nnx.split(target, nnx.Param, ...)
    rounded = nnx.merge(graphdef, jax.tree.map(_bf16, params), rest)
    fwd = jax.jit(score)  # the probe of the export's own check: its compilation is reused
    got, ref, ref32 = (np.asarray(fwd(m, tokens)) for m in (loaded, rounded, target))
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)
    scale = np.abs(ref32).max()
    assert 0 < np.abs(got - ref32).max() < 0.05 * scale  # bf16 rounding moves them a little

    config = json.loads((paths.target / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    assert (config["bos_token_id"], config["eos_token_id"]) == (tok_lib.BOS_ID,
                                                               list(tok_lib.STOP_IDS))
    assert (paths.target / "tokenizer.json").read_bytes() == (src_t / "tokenizer.json").read_bytes()
    card = (paths.target / "README.md").read_text()
    assert "1.234" in card and "Apache" in card and "tev_jax/data/README.md" in card
    assert "train.export_bundled" in card and "loss `exit`" in (paths.drafter / "README.md").read_text()

    manifest = json.loads((bundle / bundled.MANIFEST_FILE).read_text())
    assert set(manifest["files"]) == {
        "target/config.json", "target/generation_config.json", "target/model.safetensors",
        "target/tokenizer.json", "target/tokenizer_config.json", "drafter/config.json",
        "drafter/model.safetensors"}
    assert manifest["check"]["max_abs_logit_diff"] == pytest.approx(
        float(np.abs(got - ref32).max()), rel=1e-5)


def test_tokenizer_config_matches_format_chat(bundle):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(bundle / bundled.TARGET_DIR)
    ours = tok_lib.load_default_tokenizer()
    for text in ("def fibonacci(n):", "Question: 12 + 7 = ?\nAnswer:"):
        assert hf(text)["input_ids"] == ours.encode(text).ids
    user, answer = "What is 2 + 3?", "5"
    assert hf.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                  add_generation_prompt=True) == tok_lib.format_chat(user)
    two = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    assert hf.apply_chat_template(two, tokenize=False) == tok_lib.format_chat_turn(user, answer)
    assert [hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.mask_token_id] == [
        tok_lib.BOS_ID, tok_lib.EOS_ID, tok_lib.PAD_ID, tok_lib.MASK_ID]


def test_size_limit_refused_and_previous_bundle_kept(sources, bundle, tmp_path):
    out = _copy(bundle, tmp_path)
    total = sum(p.stat().st_size for p in bundle.rglob("*")
                if p.is_file() and p.name != bundled.MANIFEST_FILE)
    export_bundle(sources[0], sources[1], out, max_bytes=total,
                  dtype=jnp.bfloat16)  # exactly at the limit (the fixture's dtype)
    before = (out / bundled.MANIFEST_FILE).read_bytes()
    with pytest.raises(ValueError, match="above the"):
        export_bundle(sources[0], sources[1], out, max_bytes=total - 1, dtype=jnp.bfloat16)
    assert (out / bundled.MANIFEST_FILE).read_bytes() == before
    bundled.verify_bundle(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]  # no temporary left


def test_corrupted_or_missing_files_are_named(bundle, tmp_path):
    out = _copy(bundle, tmp_path)
    (out / "target" / "README.md").write_text("edited card")  # READMEs are not pinned
    bundled.bundled_paths(out)

    weights = out / "target" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"target/model\.safetensors is corrupted: sha256"):
        bundled.bundled_paths(out)
    assert bundled.bundled_paths(out, verify=False).target == out / "target"

    shutil.copyfile(bundle / "target" / "model.safetensors", weights)
    d = out / "drafter" / "model.safetensors"
    d.write_bytes(d.read_bytes()[:-10])
    with pytest.raises(ValueError, match=r"drafter/model\.safetensors is corrupted: .* bytes"):
        bundled.bundled_paths(out)
    d.unlink()
    with pytest.raises(ValueError, match=r"drafter/model\.safetensors is missing"):
        bundled.bundled_paths(out)


def test_missing_bundle_names_the_export_command(tmp_path, monkeypatch, capsys):
    with pytest.raises(ValueError, match="missing") as e:
        bundled.bundled_paths(tmp_path / "nothing")
    assert bundled.EXPORT_COMMAND in str(e.value)
    monkeypatch.setattr(bundled, "bundle_root", lambda: tmp_path / "nothing")
    with pytest.raises(SystemExit):
        cli.main(["generate", PROMPT])
    assert "python -m train.export_bundled --target" in capsys.readouterr().err


def test_cli_generate_explicit_paths_and_bundled_defaults(bundle, monkeypatch, capsys):
    tokenizer = tok_lib.load_default_tokenizer()
    prompt = tokenizer.encode(PROMPT).ids
    loaded = load_target(bundle / "target")
    want = tokenizer.decode(prompt + greedy_reference(loaded, [prompt], 8)[0])
    common = ["--max-new-tokens", "8"]  # ddtree (budget 64) + tev, T = 0

    rc = cli.main(["generate", PROMPT, "--target", str(bundle / "target"),
                   "--drafter", str(bundle / "drafter"), *common])
    out, err = capsys.readouterr()
    assert rc == 0 and out.strip() == want.strip() and out.startswith(PROMPT)
    assert "8 new tokens" in err and "tau = " in err and "tokens/s" in err

    monkeypatch.setattr(bundled, "bundle_root", lambda: bundle)
    rc = cli.main(["generate", PROMPT, *common])
    out, err = capsys.readouterr()
    assert rc == 0 and out.strip() == want.strip()
    assert "bundled target + bundled drafter" in err

    with pytest.raises(SystemExit):  # our drafter with a user's target makes no sense
        cli.main(["generate", PROMPT, "--target", str(bundle / "target"), *common])
    assert "--drafter is required" in capsys.readouterr().err


def test_real_bundle_generates_with_defaults(capsys):
    """The bundle inside the package (shipped by the lead): must exist, verify and run."""
    paths = bundled.bundled_paths()  # fails, naming the export command, if it is missing
    manifest = bundled.verify_bundle(paths.target.parent)
    assert manifest["dtype"] == "float32"  # shipped as trained
    assert cli.main(["generate", "def fibonacci(n):", "--max-new-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def fibonacci(n):")
    assert "bundled target + bundled drafter; ddtree (budget 64) + tev; T=0" in err
