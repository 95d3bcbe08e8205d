"""The tuning files the documentation names load with the bundled models (issue 57,
item 8: the README's ``tev-jax serve --budget auto --tuning experiments/tune/tune.json``
exited 2, the file being tuned for models the bundle no longer holds)."""

import re
from pathlib import Path

import pytest

from tev_jax.budget import AutoBudget, check_tuned_for

ROOT = Path(__file__).resolve().parents[1]


def documented_tuning_files(root: Path = ROOT) -> list[Path]:
    """Every tuning file of the repository that a page of it names (``--tuning PATH``,
    ``tuning="PATH"`` or a backticked ``PATH.json`` next to the word tuning)."""
    pages = [root / "README.md", *sorted(root.glob("experiments/*/README.md")),
             *sorted(root.glob("docs/**/*.md"))]
    named = set()
    for page in pages:
        text = page.read_text()
        named |= set(re.findall(r"--tuning\s+([\w./-]+\.json)", text))
        named |= set(re.findall(r"tuning=\"([\w./-]+\.json)\"", text))
        named |= {m for m in re.findall(r"`([\w./-]+\.json)`", text) if "tun" in m}
    return sorted(root / n for n in named if (root / n).is_file())


@pytest.fixture(scope="module")
def bundled():
    from tev_jax.models.bundled import load_bundled

    return load_bundled()


def test_every_documented_tuning_file_fits_the_bundled_models(bundled, tmp_path):
    target, drafter, _ = bundled
    files = documented_tuning_files()
    assert ROOT / "experiments" / "tune" / "tune.json" in files
    for path in files:
        check_tuned_for(AutoBudget.load(path), target, drafter)
    # negative control: a tuning of other models is refused, naming the difference
    stale = tmp_path / "tune.json"
    text = (ROOT / "experiments" / "tune" / "tune.json").read_text()
    stale.write_text(re.sub(r'"target": "[0-9a-f]+"', '"target": "0123456789abcdef"', text))
    with pytest.raises(ValueError, match="tuned for other models"):
        check_tuned_for(AutoBudget.load(stale), target, drafter)
