"""The docs say what the project is, not how it was made: no issue numbers, no work
sessions, no other agents, no "seed", no scratch path of a machine; the README's first
screen answers "which command for me"; the package metadata names the project's URLs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HISTORY = re.compile(
    r"\bissues? [0-9]+|(first|second|third|fourth|earlier|this|last) session|other agents|the seed", re.I
)
SCRATCH = re.compile(r"/tmp/(lead|scratch)\b|/work/scratch/|\b[\w-]+_cmp\.py in the session")


def _hits(pattern: re.Pattern) -> list[str]:
    return [
        f"{page.relative_to(ROOT)}:{n}: {line.strip()[:120]}"
        for page in PAGES
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if pattern.search(line)
    ]


def test_no_history_words_in_the_docs():
    assert _hits(HISTORY) == []


def test_no_scratch_paths_in_the_docs():
    assert _hits(SCRATCH) == []


def test_the_pattern_catches_what_it_is_for():
    for text in ("see issue 14", "the fourth session", "two other agents' runs", "The seed's claim"):
        assert HISTORY.search(text), text
    assert not HISTORY.search("each session dir of Ray")


def test_readme_opens_with_the_command_table():
    first_screen = "\n".join(ROOT.joinpath("README.md").read_text().splitlines()[:30])
    assert "| your case | your command |" in first_screen
    for command in (
        "modal-rl verl --backend modal",
        "modal-rl slime --backend modal",
        "bash scripts/main.sh",
    ):
        assert command in first_screen, command
    assert "modal-rl weightsync" in first_screen


def test_package_metadata_names_urls_license_and_the_command():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert {"Homepage", "Source", "Issues"} <= set(project["urls"])
    assert all(url.startswith("https://") for url in project["urls"].values())
    assert project["license"] == "Apache-2.0" and (ROOT / "LICENSE").is_file()
    assert project["scripts"] == {"modal-rl": "modal_rl.cli.main:main"}
