"""The documentation's commands agree with the README's (issue 58, item 5): the test line
the README starts with is the one ``.ci/run`` runs and the one every page gives; a page
that runs the whole suite sends users into the slow tier."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTALL = 'pip install -e ".[test,tpu]"'


def readme_test_line(readme: str) -> str:
    """The README's second set-up command: the test extras and the fast tier."""
    block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) == 2, lines
    return lines[1]


def other_test_lines(text: str, line: str) -> list[str]:
    """Every full test command (the test extras installed, then pytest) in ``text``
    that is not ``line``."""
    return [m for m in re.findall(rf"{re.escape(INSTALL)}[^\n`]*pytest[^\n`]*", text)
            if m.strip() != line]


def _pages() -> list[Path]:
    pages = [ROOT / "README.md", ROOT / ".ci" / "run"]
    for folder in ("docs", "experiments", "train", "examples"):
        pages += sorted((ROOT / folder).rglob("*.md"))
    return [p for p in pages if "_build" not in p.parts]


def test_every_page_gives_the_readmes_test_line():
    line = readme_test_line((ROOT / "README.md").read_text())
    assert '-m "not slow"' in line
    bad = {str(p.relative_to(ROOT)): other_test_lines(p.read_text(), line) for p in _pages()}
    assert not {k: v for k, v in bad.items() if v}, bad
    assert line in (ROOT / ".ci" / "run").read_text().splitlines()
    assert line in (ROOT / "docs" / "index.md").read_text()


def test_the_check_catches_another_test_line():
    """Negative control: the command docs/index.md gave before (the whole suite, slow
    tier included) is reported."""
    line = readme_test_line((ROOT / "README.md").read_text())
    old = (f'{INSTALL} && pip install --no-deps dflash==0.1.0 && python -m pytest -q -n 2 '
           "--dist loadfile tests")
    assert other_test_lines(f"```bash\n{old}\n```\n", line) == [old]
    assert other_test_lines(f"```bash\n{line}\n```\n", line) == []
