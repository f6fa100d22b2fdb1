"""The doc check's reader and runner: fenced blocks of README.md and docs/*.md, run as written.

A page's fenced blocks are what it asks a reader to type (``bash``/``sh``/``shell``/``console``,
or an unlabeled block whose first line starts with a command word) or to run (``python``), or
what it shows (``text``, ``json``, ``yaml``, ...). Every command and snippet runs here, in a
temp directory with a few inputs (``fixtures``), with the project's ``.venv/bin`` first on
PATH (so ``python`` is the venv's), no Modal credentials and no network use beyond 127.0.0.1;
a marker, an HTML comment on the line right before the fence, says otherwise:

- ``<!-- doc-check: expensive -->``: a GPU, Modal, the network or minutes; skipped knowingly.
- ``<!-- doc-check: fragment -->``: not a whole command (flags to add to one); skipped.
- ``<!-- doc-check: exit 0 2 -->``: the exit code of each command of the block, in order
  (default: 0 for each).
- ``<!-- doc-check: output -->`` (before a ``text`` block): each of its lines is in the output
  (stdout and stderr) of the last command run before it on the page; ``...`` in a line
  matches anything.

A ``json`` block right after a run command block is that command's stdout, quoted: every key
and value it shows is in the real JSON (``"...": "..."`` and a ``"..."`` value elide; a list
with ``"..."`` shows its first items, then ``"<N args>"`` for N elided items, then its last
items; ``"<...>"`` is one elided item). Anything else fails the check: an unmarked command
that fails, an exit code or a quoted output that differs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND_LANGS = {"bash", "sh", "shell", "console"}
COMMAND_WORDS = {"python", "python3", "bash", "source", "export", "ray", "git", "pip", "uv", "modal", "$"}
MARKER = re.compile(r"^<!--\s*doc-check:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^```(\S*)\s*\n(.*?)^```\s*$", re.S | re.M)
RC = "@@doc-check rc"


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    text: str
    marker: str = ""

    @property
    def where(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page.name
        return f"{page}:{self.line}"

    @property
    def is_command(self) -> bool:
        words = self.text.split(maxsplit=1)
        return self.lang in COMMAND_LANGS or (self.lang == "" and bool(words) and words[0] in COMMAND_WORDS)

    @property
    def skipped(self) -> bool:
        return self.marker in ("expensive", "fragment")

    def expected_exits(self, n: int) -> list[int]:
        if self.marker.startswith("exit "):
            codes = [int(c) for c in self.marker.split()[1:]]
            if len(codes) != n:
                raise AssertionError(f"{self.where}: marker gives {len(codes)} exit codes for {n} commands")
            return codes
        return [0] * n


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.match(before)
        out.append(Block(page, line, m.group(1), m.group(2), marker.group(1) if marker else ""))
    return out


def commands(block: Block) -> list[str]:
    """The block's commands: continuation lines joined, comment and blank lines dropped."""
    out, current = [], ""
    for raw in block.text.splitlines():
        current += raw + "\n"
        if raw.rstrip().endswith("\\"):
            continue
        if current.strip() and not current.strip().startswith("#"):
            out.append(current.rstrip("\n"))
        current = ""
    return out


@dataclass
class Ran:
    codes: list[int]
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)


def doc_env(workdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MODAL_TOKEN", "MODAL_RL_RUN_KEY"))}
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
    env["MODAL_CONFIG_PATH"] = str(workdir / "no-modal.toml")  # no credentials: as a new user
    env.update(RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def run_block(block: Block, workdir: Path, timeout: float = 120) -> Ran:
    """Every command of ``block`` in one bash, in ``workdir``; each one's exit code and output."""
    cmds = commands(block)
    script = "".join(
        f"{cmd}\n__rc=$?; echo; echo '{RC} {i}' \"$__rc\"; echo >&2; echo '{RC} {i}' \"$__rc\" >&2\n"
        for i, cmd in enumerate(cmds)
    )
    proc = subprocess.run(
        ["bash", "-c", script],
        cwd=workdir,
        env=doc_env(workdir),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    ran = Ran(codes=[])
    for stream, parts in ((proc.stdout, ran.stdout), (proc.stderr, ran.stderr)):
        chunks = re.split(rf"\n?{RC} \d+ (-?\d+)\n", stream)
        parts += chunks[0:-1:2]
        if stream is proc.stdout:
            ran.codes = [int(c) for c in chunks[1::2]]
    if len(ran.codes) != len(cmds):
        raise AssertionError(f"{block.where}: bash stopped after {len(ran.codes)} of {len(cmds)} commands")
    return ran


def _fits_list(page: list, real: list, path: str) -> list[str]:
    if "..." not in page:
        if len(page) != len(real):
            return [f"{path}: {len(real)} items, the page shows {len(page)}"]
        return [
            p for i, (a, b) in enumerate(zip(page, real, strict=True)) for p in subset(a, b, f"{path}[{i}]")
        ]
    cut = page.index("...")
    head, tail = page[:cut], page[cut + 1 :]
    elided = None
    if tail and isinstance(tail[0], str) and re.fullmatch(r"<\d+ args>", tail[0]):
        elided, tail = int(tail[0][1:].split()[0]), tail[1:]
    problems = [
        p for i, (a, b) in enumerate(zip(head, real, strict=False)) for p in subset(a, b, f"{path}[{i}]")
    ]
    if len(real) < len(head) + len(tail):
        return [*problems, f"{path}: {len(real)} items, fewer than the page shows"]
    if elided is not None and len(real) != len(head) + elided + len(tail):
        problems.append(f"{path}: {len(real) - len(head) - len(tail)} elided items, the page says {elided}")
    start = len(real) - len(tail)
    problems += [p for i, a in enumerate(tail) for p in subset(a, real[start + i], f"{path}[{start + i}]")]
    return problems


def subset(page, real, path: str = "$") -> list[str]:
    """Where ``page`` (a quoted excerpt) says something ``real`` does not."""
    if page == "..." or (isinstance(page, str) and re.fullmatch(r"<[^<>]+>", page) and page != real):
        return []
    if isinstance(page, dict):
        if not isinstance(real, dict):
            return [f"{path}: the page shows an object, the output has {real!r:.80}"]
        missing = [f"{path}.{k}: not in the output" for k in page if k != "..." and k not in real]
        return missing + [
            p for k, v in page.items() if k != "..." and k in real for p in subset(v, real[k], f"{path}.{k}")
        ]
    if isinstance(page, list):
        if not isinstance(real, list):
            return [f"{path}: the page shows a list, the output has {real!r:.80}"]
        return _fits_list(page, real, path)
    return [] if page == real else [f"{path}: the page shows {page!r:.120}, the output has {real!r:.120}"]


def output_problems(quoted: Block, output: str) -> list[str]:
    """Lines of a ``doc-check: output`` block missing from ``output``."""
    problems = []
    for line in quoted.text.splitlines():
        if not line.strip():
            continue
        pattern = ".*".join(re.escape(part.strip()) for part in line.split("..."))
        if not re.search(pattern, output):
            problems.append(f"{quoted.where}: not in the output: {line.strip()[:160]}")
    return problems


def json_problems(quoted: Block, stdout: str) -> list[str]:
    page = json.loads(quoted.text)
    try:
        real = json.loads(stdout)
    except json.JSONDecodeError:
        return [f"{quoted.where}: the command's stdout is not JSON: {stdout[:200]!r}"]
    return [f"{quoted.where}: {p}" for p in subset(page, real)]
