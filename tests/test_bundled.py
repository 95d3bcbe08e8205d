"""The bundled demo models: export (float32 or bfloat16, atomic, size-limited, pinned by SHA-256),
lookup of the target and its two drafters (ExitTrain, the default, and DFlash), corruption
detection (one damaged drafter leaves the other usable), the names ``bundled`` and
``bundled:NAME`` on both command lines, ``python -m train.demo.build``'s help and
errors, `tev-jax generate` with and without explicit paths and `tev-jax compare`.

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
from tev_jax.cli.compare import COMPARE_METHODS
from tev_jax.data import tokenizer as tok_lib
from tev_jax.models import Target, bundled, load_target, save_target, score
from tev_jax.models.checkpoint_io import read_headers
from tev_jax.models.drafter import Drafter
from tev_jax.models.drafter_io import drafter_config_for, load_drafter, save_drafter
from train.demo.build import DemoPlan
from train.demo.export_bundled import PROBE_TEXT, export_bundle
from train.demo.train_target import TargetTrainConfig

PROMPT = "def fibonacci(n):"


def _random_demo_models():
    """Random models shaped like the shipped ones (`train.demo.train_target`,
    `train.demo.build`), so the real bundle's test reuses the CLI test's compilation:
    (target, ExitTrain drafter, DFlash drafter); the two drafters differ."""
    cfg = TargetTrainConfig().model_config(tok_lib.load_default_tokenizer().get_vocab_size())
    rng = np.random.default_rng(0)
    target = _numpy_build(lambda: Target(cfg, rngs=nnx.Rngs(0)), rng, kernel_std=0.05,
                          norm_std=0.2)
    plan = DemoPlan()
    dcfg = drafter_config_for(cfg, num_layers=plan.drafter_layers, block_size=plan.block_size,
                              mask_token_id=tok_lib.MASK_ID)
    drafters = [_numpy_build(lambda: Drafter(dcfg, rngs=nnx.Rngs(0)), rng, kernel_std=0.05,
                             norm_std=0.3) for _ in range(2)]
    return target, *drafters


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Float32 source checkpoints laid out like the training runs (logs next to them)."""
    root = tmp_path_factory.mktemp("runs")
    target, drafter, dflash = _random_demo_models()
    save_target(target, root / "target" / "hf", tokenizer=tok_lib.load_default_tokenizer())
    (root / "target" / "log.jsonl").write_text(
        json.dumps({"step": 10, "loss": 5.0}) + "\n"
        + json.dumps({"step": 20, "loss": 4.0, "val": {"code": 1.234, "prose": 4.567}}) + "\n")
    save_drafter(drafter, root / "ft" / "drafter")
    (root / "ft" / "config.json").write_text(json.dumps({"loss": "reach", "budget": 32,
                                                         "exit_lambda": 0.1}))
    save_drafter(dflash, root / "dflash" / "drafter")
    (root / "dflash" / "config.json").write_text(json.dumps({"loss": "token", "budget": 32}))
    drafters = {"exittrain": root / "ft" / "drafter", "dflash": root / "dflash" / "drafter"}
    return root / "target" / "hf", drafters, target, {"exittrain": drafter, "dflash": dflash}


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
    src_t, src_d, target, drafters = sources
    paths = bundled.bundled_paths(bundle)
    assert paths.drafter == paths.drafters["exittrain"] == bundle / "drafters" / "exittrain"
    for sub in (paths.target, *paths.drafters.values()):
        assert {h.dtype for h in read_headers(sub).values()} == {"BF16"}
    loaded = load_target(paths.target)
    pairs = [(target, loaded)] + [(drafters[k], load_drafter(paths.drafters[k], loaded))
                                  for k in bundled.DRAFTERS]
    for original, got in pairs:
        want, have = _flat_params(original), _flat_params(got)
        assert want.keys() == have.keys()
        for p in want:
            np.testing.assert_array_equal(have[p], _bf16(want[p]), err_msg=str(p))
    # each name holds its own drafter (the two differ, so a swap would fail above)
    a, b = (_flat_params(drafters[k]) for k in bundled.DRAFTERS)
    assert any(not np.array_equal(a[p], b[p]) for p in a)

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
    cards = {k: (paths.drafters[k] / "README.md").read_text() for k in bundled.DRAFTERS}
    assert "train.demo.export_bundled" in card and "loss `reach`" in cards["exittrain"]
    assert "(ExitTrain)" in cards["exittrain"] and "bundled:exittrain" in cards["exittrain"]
    assert "token objective" in cards["dflash"] and "loss `token`" in cards["dflash"]

    manifest = json.loads((bundle / bundled.MANIFEST_FILE).read_text())
    assert set(manifest["files"]) == {
        "target/config.json", "target/generation_config.json", "target/model.safetensors",
        "target/tokenizer.json", "target/tokenizer_config.json",
        "drafters/exittrain/config.json", "drafters/exittrain/model.safetensors",
        "drafters/dflash/config.json", "drafters/dflash/model.safetensors"}
    assert {k: v["source"] for k, v in manifest["drafters"].items()} == {
        k: str(v) for k, v in src_d.items()}
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
    d = out / "drafters" / "dflash" / "model.safetensors"
    d.write_bytes(d.read_bytes()[:-10])
    with pytest.raises(ValueError,
                       match=r"drafters/dflash/model\.safetensors is corrupted: .* bytes"):
        bundled.bundled_paths(out)
    d.unlink()
    with pytest.raises(ValueError, match=r"drafters/dflash/model\.safetensors is missing"):
        bundled.bundled_paths(out)
    shutil.rmtree(out / "drafters" / "dflash")
    with pytest.raises(ValueError, match=r"no drafters/dflash/ directory"):
        bundled.bundled_paths(out)


def test_export_needs_both_drafters_and_load_bundled_names_them(sources, bundle, tmp_path):
    with pytest.raises(ValueError, match=r"ships the drafters \('exittrain', 'dflash'\)"):
        export_bundle(sources[0], {"exittrain": sources[1]["exittrain"]}, tmp_path / "m")
    assert not (tmp_path / "m").exists()
    with pytest.raises(ValueError, match="unknown bundled drafter 'ddtree'"):
        bundled.load_bundled(drafter="ddtree", root=bundle)
    _, d_exit, _ = bundled.load_bundled(root=bundle)
    _, d_flash, _ = bundled.load_bundled(drafter="dflash", root=bundle)
    want = {k: _flat_params(load_drafter(bundle / "drafters" / k, load_target(
        bundle / "target"))) for k in bundled.DRAFTERS}
    for got, k in ((d_exit, "exittrain"), (d_flash, "dflash")):
        have = _flat_params(got)
        assert all(np.array_equal(have[p], want[k][p]) for p in have), k


def test_missing_bundle_names_the_export_command(tmp_path, monkeypatch, capsys):
    with pytest.raises(ValueError, match="missing") as e:
        bundled.bundled_paths(tmp_path / "nothing")
    assert bundled.EXPORT_COMMAND in str(e.value)
    monkeypatch.setattr(bundled, "bundle_root", lambda: tmp_path / "nothing")
    with pytest.raises(SystemExit):
        cli.main(["generate", PROMPT])
    assert "python -m train.demo.export_bundled --target" in capsys.readouterr().err


def test_one_bundled_drafter_damaged_leaves_the_other_usable(tmp_path):
    """Issue 26, finding 18: damage to one bundled drafter no longer blocks the other."""
    root = tmp_path / "models"
    for sub in ("target", "drafters/exittrain", "drafters/dflash"):
        (root / sub).mkdir(parents=True)
        (root / sub / "config.json").write_text("{}")
        (root / sub / "model.safetensors").write_bytes(sub.encode())
    bundled.write_manifest(root, {"dtype": "float32"})
    (root / "drafters" / "dflash" / "model.safetensors").write_bytes(b"damaged")
    paths = bundled.bundled_paths(root, drafters=("exittrain",))
    assert paths.drafter == root / "drafters" / "exittrain"
    bundled.bundled_paths(root, drafters=())
    with pytest.raises(ValueError, match="dflash/model.safetensors is corrupted"):
        bundled.bundled_paths(root, drafters=("dflash",))


def test_the_bundled_target_named_by_its_folder_takes_the_bundled_drafter():
    """Issue 47, items 10 and 5: --target bundled, or the bundled target's folder, with
    the default drafter is the bundled pair (it was refused for want of --drafter)."""
    import argparse

    from tev_jax.cli import flags

    paths = bundled.bundled_paths()
    for target in ("bundled", str(paths.target)):
        args = argparse.Namespace(target=target, drafter=None, builder="ddtree")
        t, d, where = flags.checkpoint_dirs(args)
        assert (t, d) == (str(paths.target), str(paths.drafter))
        assert where == "bundled target + bundled exittrain drafter"


def test_bundled_names_a_training_target_and_drafter():
    """Issue 47, item 5: tev-train's --target-path bundled and --drafter-path
    bundled[:NAME] name the bundled models, as tev-train rollouts --target bundled does."""
    from train import __main__ as train_cli

    paths = bundled.bundled_paths()
    ns = train_cli.build_parser().parse_args(
        ["run", "--target-path", "bundled", "--drafter-path", "bundled:dflash",
         "--data-dir", "d"])
    cfg = train_cli.config_from_args(ns)
    assert cfg.target_path == str(paths.target)
    assert cfg.drafter_path == str(paths.drafters["dflash"])
    ns = train_cli.build_parser().parse_args(["run", "--drafter-path", "bundled"])
    assert train_cli.config_from_args(ns).drafter_path == str(paths.drafter)
    ns = train_cli.build_parser().parse_args(["run", "--drafter-path", "bundled:nope"])
    with pytest.raises(ValueError, match="unknown bundled drafter 'nope'"):
        train_cli.config_from_args(ns)


def test_demo_models_help_and_errors(tmp_path, capsys):
    """Issue 47, items 6 and 10: python -m train.demo.build --help names itself and
    documents --runs; a missing data folder is one line, exit 2."""
    from train.demo import build as demo_models

    with pytest.raises(SystemExit):
        demo_models.main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m train.demo.build") and "the folder every" in out
    code = demo_models.main(["--runs", str(tmp_path / "runs"), "--only", "corpus",
                             "--data-dir", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "lacks prose.jsonl" in err


@pytest.mark.slow  # the fast tier's time (README: under 10 minutes here), 2026-12-06
def test_cli_generate_explicit_paths_and_bundled_defaults(bundle, monkeypatch, capsys,
                                                          tmp_path):
    tokenizer = tok_lib.load_default_tokenizer()
    prompt = tokenizer.encode(PROMPT).ids
    loaded = load_target(bundle / "target")
    want = tokenizer.decode(prompt + greedy_reference(loaded, [prompt], 8)[0])
    common = ["--max-new-tokens", "8"]  # ddtree (budget 64) + tev, T = 0

    rc = cli.main(["generate", PROMPT, "--target", str(bundle / "target"),
                   "--drafter", str(bundle / "drafters" / "exittrain"), *common])
    out, err = capsys.readouterr()
    assert rc == 0 and out.strip() == want.strip() and out.startswith(PROMPT)
    assert "8 new tokens" in err and "tau = " in err and "tokens/s" in err

    monkeypatch.setattr(bundled, "bundle_root", lambda: bundle)
    rc = cli.main(["generate", PROMPT, *common])
    out, err = capsys.readouterr()
    assert rc == 0 and out.strip() == want.strip()
    assert "bundled target + bundled exittrain drafter" in err
    rc = cli.main(["generate", PROMPT, "--drafter", "bundled:dflash", "--verifier", "predraw",
                   *common])
    out, err = capsys.readouterr()
    assert rc == 0 and out.strip() == want.strip()
    assert "bundled target + bundled dflash drafter; ddtree (budget 64) + predraw" in err

    with pytest.raises(SystemExit):
        cli.main(["generate", PROMPT, "--drafter", "bundled:eagle", *common])
    assert "unknown bundled drafter 'eagle'" in capsys.readouterr().err
    # a target of the user's own (here a copy of ours) needs its own drafter: ours only
    # fit our target; the bundled folder itself is the bundled target
    own = tmp_path / "my-target"
    shutil.copytree(bundle / "target", own)
    for drafter in ([], ["--drafter", "bundled:dflash"]):
        with pytest.raises(SystemExit):
            cli.main(["generate", PROMPT, "--target", str(own), *drafter, *common])
        assert "--drafter is required" in capsys.readouterr().err


@pytest.mark.slow  # the fast tier's time (README: under 10 minutes here), 2026-12-06
def test_cli_compare_runs_the_three_methods_on_the_same_prompts(bundle, monkeypatch, capsys):
    monkeypatch.setattr(bundled, "bundle_root", lambda: bundle)
    assert cli.main(["compare", PROMPT, "def add(a, b):", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    lines = {line.split("  ")[0]: line.split() for line in out.splitlines()}
    for label, *_ in COMPARE_METHODS:
        assert label in lines, out
    ar = lines["AR (target alone)"]
    assert ar[-5:-1] == ["1.00", ar[-4], "1.00x", "1.00-1.00"] and 2 <= int(ar[-1]) <= 16
    for label in ("DFlash + DDTree + predraw", "ExitTrain + DDTree + TEV"):
        tau, speed, n = float(lines[label][-5]), float(lines[label][-4]), lines[label][-1]
        low, high = map(float, lines[label][-2].split("-"))  # issue 47, item 8: the spread
        assert tau >= 1.0 and speed > 0 and n == ar[-1] and low <= high
    assert "greedy outputs identical across methods: yes" in out


def test_real_bundle_generates_with_defaults(capsys):
    """The bundle inside the package (shipped by the lead): must exist, verify and run."""
    paths = bundled.bundled_paths()  # fails, naming the export command, if it is missing
    manifest = bundled.verify_bundle(paths.target.parent)
    assert manifest["dtype"] == "float32"  # shipped as trained
    assert cli.main(["generate", "def fibonacci(n):", "--max-new-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def fibonacci(n):")
    assert "bundled target + bundled exittrain drafter; ddtree (budget 64) + tev; T=0" in err


def test_the_shipped_chat_template_opens_the_user_turn_with_the_system_text():
    """Issue 57, item 6: the bundled target's chat template (tokenizer_config.json)
    renders leading system messages as `format_chat` does, user turns as before (what the
    drafters were trained on), the same as transformers' ``apply_chat_template``, and
    refuses system messages with no user turn after them."""
    import json

    from transformers import PreTrainedTokenizerFast

    from tev_jax import text_io
    from tev_jax.data.tokenizer import format_chat

    paths = bundled.bundled_paths()
    config = json.loads((paths.target / "tokenizer_config.json").read_text())
    chat = text_io.chat_formatter(config)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(paths.target / "tokenizer.json"),
                                 **{k: v for k, v in config.items() if k != "tokenizer_class"})
    user = [{"role": "user", "content": "What is 2?"}]
    cases = {
        "user": (user, format_chat("What is 2?")),
        "system": ([{"role": "system", "content": "Be brief."}] + user,
                   format_chat("What is 2?", system="Be brief.")),
        "two": ([{"role": "system", "content": "A."}, {"role": "system", "content": "B."}] + user,
                format_chat("What is 2?", system="A.\n\nB.")),
    }
    for name, (messages, want) in cases.items():
        assert chat(messages) == want, name
        assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == want
    for bad in ([{"role": "system", "content": "x"}],
                [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]):
        with pytest.raises(ValueError, match="chat template"):
            chat(bad)
