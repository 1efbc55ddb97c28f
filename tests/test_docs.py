"""The front door and the pages behind it: the README stays short, opens with every command and a table of
contents, and no link in README.md, ARCHITECTURE.md or docs/ dangles (files and #anchors both)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMANDS = ("topo", "recommend", "run", "probe", "kill-stale", "check", "accept", "hang", "slow", "doctor")
MAX_README_LINES = 400

_LINK = re.compile(r"(?<!!)\[(?:[^\]]*)\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks (a heading or link inside a fence is an example, not a link)."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text(encoding="utf-8")):
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = _slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def _links(path: Path) -> list[str]:
    return [m.group(1) for line in _prose(path.read_text(encoding="utf-8")) for m in _LINK.finditer(line)]


def test_slug_follows_github():
    speed = "Is DataParallel or DDP worth it? `--mode speed`"
    assert _slug(speed) == "is-dataparallel-or-ddp-worth-it---mode-speed"
    assert _slug("`gputopo run` arms the recorder and leaves a run record") == (
        "gputopo-run-arms-the-recorder-and-leaves-a-run-record"
    )


def test_readme_is_a_short_front_door():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < MAX_README_LINES, f"README.md has {len(lines)} lines; the detail belongs in docs/"
    opening = "\n".join(lines[: lines.index("## Contents")])
    missing = [c for c in COMMANDS if f"gputopo {c}" not in opening]
    assert not missing, f"the README's opening never names: {missing}"


def test_readme_table_of_contents_lists_every_section():
    text = README.read_text(encoding="utf-8")
    sections = [_slug(h) for h in re.findall(r"^## (.+)$", "\n".join(_prose(text)), re.M) if h != "Contents"]
    toc = text.split("## Contents", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"\]\(#([^)]+)\)", toc)
    assert listed == sections


def test_every_command_has_its_page_and_a_row():
    text = README.read_text(encoding="utf-8")
    for c in COMMANDS:
        assert re.search(rf"^\| `gputopo {re.escape(c)}\b", text, re.M), f"no row for {c} in README's table"
    for c in ("doctor", "topo", "recommend", "run", "probe", "hang", "slow", "check", "accept", "kill-stale"):
        assert (ROOT / "docs" / f"{c}.md").is_file()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_link_dangles(page: Path):
    bad = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = page if not path_part else (page.parent / unquote(path_part)).resolve()
        if not dest.exists():
            bad.append(f"{target}: no such file")
            continue
        if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


def test_code_cites_only_what_the_repository_has():
    """A reference in the code to a design note or a rule's source must resolve inside the repository: no
    DESIGN.md outside it, no issue number a user cannot open."""
    offenders = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"(?<![\w/])DESIGN\.md\b", line) or re.search(r"\bissue \d+\b", line, re.I):
                offenders.append(f"{path.relative_to(ROOT)}:{n}")
            for doc, section in re.findall(r"\b(docs/[\w-]+\.md)\b,?(?: \"([^\"]+)\")?", line):
                if not (ROOT / doc).is_file():
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {doc}")
                elif section and not any(a.startswith(_slug(section)) for a in _anchors(ROOT / doc)):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {doc} has no section {section!r}")
    assert not offenders, offenders
