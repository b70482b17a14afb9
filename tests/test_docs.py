"""The README is a user's guide that stays true to the code: its size, no dated entries, its two
commands first, every flag its command tables name exists in the real argparse (and every flag
of a command is in its table), and every file it or a docs/ page links to exists."""

import re
from pathlib import Path

import pytest

from autopar.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
REPORTS = ROOT / "reports/README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def _subparsers():
    ap = build_parser()
    sub = next(a for a in ap._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices


def test_sizes_and_no_dated_entries():
    text, reports = README.read_text(), REPORTS.read_text()
    assert len(text) <= 30_000, len(text)
    assert len(reports) <= 20_000, len(reports)
    for name, t in (("README.md", text), ("reports/README.md", reports)):
        dated = [line for line in t.splitlines() if re.search(r"\b20\d\d-\d\d-\d\d\b|\brun \d+\b|\bsession\b", line)]
        assert not dated, (name, dated[:3])


def test_the_two_commands_come_first():
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    first = [line for line in blocks[0].splitlines() if line and not line.startswith("#")]
    assert first == ["bash scripts/setup.sh && bash scripts/example.sh", "bash scripts/test.sh"]


def _table_flags(section: str) -> set[str]:
    """The flags in the first column of the flag table of README section ``### `autopar CMD```."""
    text = README.read_text()
    m = re.search(r"^### `autopar " + re.escape(section) + r"`\n(.*?)(?=^##)", text, re.S | re.M)
    assert m, f"no README section for autopar {section}"
    flags = set()
    for line in m.group(1).splitlines():
        if line.startswith("| `"):
            first = line.split(" | ")[0]
            flags |= set(re.findall(r"(?<![\w-])(-[-\w]+|-o)\b", first))
    return flags


@pytest.mark.parametrize("cmd", ["calibrate", "plan", "execute"])
def test_flag_tables_match_argparse(cmd):
    parser = _subparsers()[cmd]
    real = {s for a in parser._actions for s in a.option_strings
            if s not in ("-h", "--help") and a.help != "==SUPPRESS=="}
    documented = _table_flags(cmd)
    assert documented, cmd
    assert not documented - real, f"README names flags autopar {cmd} lacks: {sorted(documented - real)}"
    # every real flag is in the table, in its long or short form
    missing = {a.option_strings[-1] for a in parser._actions
               if a.option_strings and a.help != "==SUPPRESS=="
               and not set(a.option_strings) & documented and "--help" not in a.option_strings}
    assert not missing, f"autopar {cmd} flags missing from the README: {sorted(missing)}"


def test_every_command_has_a_readme_section():
    text = README.read_text()
    for cmd in _subparsers():
        assert f"autopar {cmd}" in text, cmd


@pytest.mark.parametrize("page", [README, REPORTS] + DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_exist(page):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if "://" in target:
            continue
        assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to missing {target}"
