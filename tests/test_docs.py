"""The README is a manual and the guides under docs/ hold the rest: these tests keep the
README short and opening with the two set-up commands, every relative link in the README and
the guides pointing at a file that exists, every guide linked from the README, and the
commands the README lists being the CLI's real subcommands. They read files and run
`python -m qeval.cli --help` once; nothing depends on time or the network."""
from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_README_LINES = 260

_FENCE = re.compile(r"(?ms)^```.*?^```[ \t]*$")
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")


def _markdown_files() -> list[Path]:
    """README.md and every Markdown file directly under docs/, in a fixed order."""
    return [README] + sorted(DOCS.glob("*.md"))


def _links(text: str) -> list[str]:
    """The targets of every `[text](target)` and `![alt](target)` outside code blocks and
    code spans, in order."""
    prose = _CODE_SPAN.sub("", _FENCE.sub("", text))
    return _LINK.findall(prose)


def _is_external(target: str) -> bool:
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) is not None  # http:, https:, mailto:, ...


def _readme_commands_block() -> str:
    """The first fenced block of the README's "Commands and exit codes" section."""
    text = README.read_text(encoding="utf-8")
    section = re.search(r"(?ms)^## Commands and exit codes\n(.*?)(?=^## |\Z)", text)
    assert section, 'README.md has no "## Commands and exit codes" section'
    block = re.search(r"(?ms)^```[^\n]*\n(.*?)^```", section.group(1))
    assert block, 'the README\'s "Commands and exit codes" section has no code block'
    return block.group(1)


@functools.lru_cache(maxsize=1)
def _cli_subcommands() -> frozenset[str]:
    """The subcommands `python -m qeval.cli --help` lists (typer's rich panel or click's plain
    "Commands:" list), run once per session."""
    env = dict(os.environ, COLUMNS="200", TERM="dumb", NO_COLOR="1")
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "--help"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    names, in_commands = [], False
    for line in p.stdout.splitlines():
        if re.search(r"\bCommands\b", line):
            in_commands = True
            continue
        if not in_commands:
            continue
        if line.lstrip().startswith(("╰", "╭")) or not line.strip():
            if names:
                break
            continue
        m = re.match(r"^[│|]?\s{1,2}([a-z][a-z0-9_-]*)(?:\s{2,}|\s*[│|]?\s*$)", line)
        if m:
            names.append(m.group(1))
    assert names, f"no command list found in `qeval --help`:\n{p.stdout}"
    return frozenset(names)


def test_readme_is_short_and_opens_with_the_two_setup_commands():
    """At most MAX_README_LINES lines; after the title and the lead paragraph, the first
    thing past the "Quick start" heading is a code block holding `make demo` and `make test`."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"
    assert lines[0].startswith("# "), "README.md must start with its title"
    first_fence = next(i for i, line in enumerate(lines) if line.startswith("```"))
    before = lines[1:first_fence]
    headings = [line for line in before if line.startswith("#")]
    assert headings == ["## Quick start"], f"before the set-up commands: {headings}"
    lead = [line for line in before[: before.index("## Quick start")] if line.strip()]
    assert lead, "README.md needs a lead paragraph under its title"
    after_heading = [line for line in before[before.index("## Quick start") + 1:] if line.strip()]
    assert after_heading == [], f"text between the Quick start heading and its commands: {after_heading}"
    end = next(i for i in range(first_fence + 1, len(lines)) if lines[i].startswith("```"))
    commands = [line.split("#")[0].strip() for line in lines[first_fence + 1:end]]
    assert "make demo" in commands and "make test" in commands, commands


def test_every_relative_link_points_at_a_file_that_exists():
    """Every `](path)` in README.md and docs/*.md, less web and anchor-only links and any
    `#anchor`, names a file or folder that exists, relative to the file holding the link."""
    missing = []
    for md in _markdown_files():
        for target in _links(md.read_text(encoding="utf-8")):
            if _is_external(target) or target.startswith("#"):
                continue
            path = target.split("#", 1)[0]
            if not (md.parent / path).exists():
                missing.append(f"{md.relative_to(REPO)}: {target}")
    assert not missing, "links to nothing:\n" + "\n".join(missing)


def test_readme_links_every_guide():
    """Every docs/*.md is reachable from the README (its "Guides" section)."""
    targets = {t.split("#", 1)[0] for t in _links(README.read_text(encoding="utf-8"))}
    unlinked = [f"docs/{p.name}" for p in sorted(DOCS.glob("*.md")) if f"docs/{p.name}" not in targets]
    assert not unlinked, f"guides the README does not link: {unlinked}"


def test_link_parser_sees_links_and_skips_code():
    """The link parser finds plain and image links and ignores code blocks and spans."""
    text = "a [x](one.md) ![y](img.png \"t\") `[no](span.md)`\n```\n[no](block.md)\n```\n[z](two.md#a)\n"
    assert _links(text) == ["one.md", "img.png", "two.md#a"]
    assert _is_external("https://example.com") and not _is_external("docs/x.md")


def test_readme_commands_are_the_clis_subcommands():
    """Every `qeval <subcommand>` in the README's commands block is a real subcommand of
    `qeval --help`, and every subcommand is listed there."""
    named = {line.split()[1] for line in _readme_commands_block().splitlines()
             if line.startswith("qeval ") and len(line.split()) > 1}
    real = _cli_subcommands()
    assert named, "the README's commands block names no `qeval` command"
    assert named <= real, f"not qeval subcommands: {sorted(named - real)} (real: {sorted(real)})"
    assert real <= named, f"subcommands the README's commands block leaves out: {sorted(real - named)}"


def test_the_design_layout_names_every_module_and_only_modules_that_exist():
    """docs/design.md's layout block stays true: every top-level module and package of qeval is
    named in it, and every ``name.py`` it names exists in qeval/ or tools/."""
    import re
    text = (REPO / "docs" / "design.md").read_text()
    block = text[text.index("## A layout that shows the flow"):].split("```")[1]
    named = set(re.findall(r"\b([a-z_][a-z0-9_]*\.py)\b", block))
    folders = set(re.findall(r"\b([a-z_]+)/", block))
    pkg = REPO / "qeval"
    top = sorted(p.name for p in pkg.glob("*.py") if p.name != "__init__.py")
    subs = sorted(p.name for p in pkg.iterdir() if (p / "__init__.py").exists())
    assert [m for m in top if m not in named] == []
    assert [d for d in subs if d not in folders] == []
    present = {p.name for p in pkg.rglob("*.py")} | {p.name for p in (REPO / "tools").glob("*.py")}
    assert sorted(n for n in named if n not in present) == []
