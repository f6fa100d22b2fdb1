"""The doc check, inline part: commands quoted in prose (`python -m ...` in backticks).

Fenced blocks run as written (``test_docs_commands``). A command quoted inline in a sentence is
usually a reference ("see `python -m benchmarks chaos --quick`") and often expensive, so it is
not run; what can drift is checked instead: every inline ``python -m <our module> ...`` names a
module that starts, a subcommand or suite that exists, and only flags its ``--help`` lists
(words after ``--`` belong to the framework the launcher wraps). ``bash <path>`` names a script
that exists. Third-party commands (``ray start``, ``pip install``) are prose, not checked.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys

import pytest

from tests._doc_check import FENCE, PAGES, ROOT

OURS = ("modal_rl", "verl_modal", "slime_modal", "benchmarks", "patches")
SPAN = re.compile(r"`([^`\n]+)`")
COMMAND = re.compile(r"^(?:\.venv/bin/)?python3? -m (\S+)(.*)$")


def inline_commands() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        prose = FENCE.sub("", page.read_text())
        for m in SPAN.finditer(prose):
            text = m.group(1).strip()
            cmd = COMMAND.match(text)
            if (cmd and cmd.group(1).split(".")[0] in OURS) or text.startswith("bash "):
                out.append((page.relative_to(ROOT).as_posix(), text))
    return out


@functools.cache
def _help(*argv: str) -> tuple[int, str]:
    r = subprocess.run(
        [sys.executable, "-m", *argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    return r.returncode, r.stdout + r.stderr


@functools.cache
def _suites() -> str:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", "list"], cwd=ROOT, capture_output=True, text=True, timeout=120
    ).stdout


def _words(rest: str) -> list[str]:
    words = []
    for word in rest.split():
        if word == "--":
            break  # the wrapped framework's own arguments
        words.append(word)
    return words


CASES = inline_commands()


def test_the_pages_quote_inline_commands():
    assert len(CASES) > 20, CASES  # the reader found them (a broken pattern would find none)


def problem(text: str) -> str | None:
    """What is wrong with an inline command, or None."""
    if text.startswith("bash "):
        script = text.split()[1]
        if script.startswith("<"):
            return None  # a placeholder (prose about commands), not a command
        return None if (ROOT / script).is_file() else f"{script} does not exist"
    module, rest = COMMAND.match(text).groups()
    if module == "pytest":
        return None
    rc, help_text = _help(module)
    if rc != 0:
        return f"`python -m {module} --help` exits {rc}: {help_text[-300:]}"
    words = _words(rest)
    first = words[0] if words else ""
    if first and re.fullmatch(r"[a-z][a-z0-9_-]*", first):
        if module == "benchmarks":
            if first not in _suites().split():
                return f"no benchmark suite {first!r}"
        else:
            sub_rc, sub_help = _help(module, first)
            if sub_rc != 0:
                return f"no subcommand {first!r} ({sub_help[-200:]})"
            help_text += sub_help
    for word in words:
        flag = word.split("=", 1)[0].strip("[]")
        if flag.startswith("--") and len(flag) > 2 and flag not in help_text:
            return f"{flag} is not in its --help"
    return None


@pytest.mark.parametrize(("page", "text"), CASES, ids=[f"{p}:{t[:60]}" for p, t in CASES])
def test_an_inline_command_names_what_exists(page, text):
    assert problem(text) is None, f"{page}: `{text}`: {problem(text)}"


@pytest.mark.parametrize(
    "text",
    [
        "python -m benchmarks chaoss --quick",
        "python -m modal_rl.weightsync receive --untill 3",
        "python -m modal_rl.weightsync recieve --tcp H:P",
        "python -m verl_modal.nope --help",
        "bash scripts/nope.sh",
    ],
)
def test_the_inline_check_catches_drift(text):
    assert problem(text) is not None
