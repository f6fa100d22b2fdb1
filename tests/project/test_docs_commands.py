"""Docs that cannot drift: every command and snippet in README.md and docs/*.md runs as
written and shows what the page says (the conventions: ``tests/_doc_check.py``, and
docs/architecture.md's plumbing section)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests._doc_check import PAGES, ROOT, Block, blocks, doc_env, json_problems, output_problems, run_block
from tests._slime_lines import GLM47_MODEL, qwen3_4b


def fixtures(workdir: Path) -> None:
    """What the pages assume a reader has: two tiny safetensors files (the weight-sync CLI's
    A and B) and a slime checkout's model scripts (``slime/scripts/models/*.sh``, transcribed
    in ``tests/_slime_lines.py``)."""
    import torch
    from safetensors.torch import save_file

    base = {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "b": torch.zeros(8)}
    save_file(base, str(workdir / "A.safetensors"))
    save_file({"w": base["w"] + 0.5, "b": base["b"]}, str(workdir / "B.safetensors"))
    models = workdir / "slime" / "scripts" / "models"
    models.mkdir(parents=True)
    qwen = qwen3_4b()
    qwen = qwen[qwen.index("--swiglu") : qwen.index("--qk-layernorm") + 1]
    for name, args in (("qwen3-4B.sh", qwen), ("glm4.7-30B-A3B.sh", GLM47_MODEL)):
        quoted = " ".join(f"'{a}'" for a in args)
        (models / name).write_text(f"MODEL_ARGS=({quoted})\n")


def check_page(page: Path, workdir: Path) -> tuple[list[str], int]:
    """Problems on ``page`` and how many blocks ran."""
    problems, ran_count, last = [], 0, None
    page_blocks = blocks(page)
    for i, block in enumerate(page_blocks):
        if block.lang == "python" and not block.skipped:
            out = subprocess.run(
                [sys.executable, "-c", block.text],
                cwd=workdir,
                env=doc_env(workdir),
                capture_output=True,
                text=True,
                timeout=120,
            )
            ran_count += 1
            if out.returncode != 0:
                problems.append(f"{block.where}: the snippet failed: {out.stderr.strip()[-600:]}")
            last = (out.stdout, out.stdout + out.stderr)
            continue
        if block.is_command and not block.skipped:
            ran = run_block(block, workdir)
            ran_count += 1
            want = block.expected_exits(len(ran.codes))
            if ran.codes != want:
                errs = " | ".join(e.strip()[-300:] for e in ran.stderr)
                problems.append(f"{block.where}: exit codes {ran.codes}, the page says {want}: {errs}")
            last = (ran.stdout[-1], ran.stdout[-1] + ran.stderr[-1])
            following = page_blocks[i + 1] if i + 1 < len(page_blocks) else None
            if following is not None and following.lang == "json" and not following.skipped:
                problems += json_problems(following, last[0])
            continue
        if block.marker == "output":
            if last is None:
                problems.append(f"{block.where}: an output block with no command run before it")
            else:
                problems += output_problems(block, last[1])
        elif block.marker and not block.skipped and not block.marker.startswith("exit"):
            problems.append(f"{block.where}: unknown doc-check marker {block.marker!r}")
    return problems, ran_count


# Pages whose cheap commands take over ~10 s (verl's dry runs import verl: ~8 s each).
SLOW_PAGES = {"docs/quickstart-verl.md"}


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(
            p,
            id=str(p.relative_to(ROOT)),
            marks=[pytest.mark.slow] * (str(p.relative_to(ROOT)) in SLOW_PAGES),
        )
        for p in PAGES
    ],
)
def test_page_commands_run_as_written(page, tmp_path):
    fixtures(tmp_path)
    problems, _ = check_page(page, tmp_path)
    assert not problems, "\n".join(problems)


def test_every_command_block_is_run_or_marked():
    """The check's reach: every command block either runs or is marked skipped on purpose."""
    counted = [b for p in PAGES for b in blocks(p) if b.is_command or b.lang == "python"]
    assert len([b for b in counted if not b.skipped]) >= 10
    for b in counted:
        assert b.marker in ("", "expensive", "fragment") or b.marker.startswith("exit "), b.where


# ---- the check itself fails on drift ---------------------------------------------------------
FAKE = """# fake

```bash
python -c "import sys; print('{{\\"a\\": 1, \\"b\\": [1, 2, 3]}}'); sys.exit({rc})"
```

```json
{json}
```

<!-- doc-check: output -->
```text
{out}
```
"""


def fake_page(tmp_path: Path, rc=0, json='{"a": 1, "b": [1, "...", 3]}', out='{"a": 1, ...}') -> Path:
    page = tmp_path / "fake.md"
    page.write_text(FAKE.format(rc=rc, json=json, out=out))
    return page


def test_a_page_that_matches_passes(tmp_path):
    assert check_page(fake_page(tmp_path), tmp_path) == ([], 1)


@pytest.mark.parametrize(
    "change, why",
    [
        ({"rc": 2}, "exit codes [2], the page says [0]"),
        ({"json": '{"a": 2}'}, "$.a: the page shows 2, the output has 1"),
        ({"json": '{"c": 1}'}, "$.c: not in the output"),
        ({"json": '{"b": [1, "...", "<5 args>", 3]}'}, "1 elided items, the page says 5"),
        ({"out": "a line the command never printed"}, "not in the output: a line the command never"),
    ],
)
def test_drift_fails_the_check(tmp_path, change, why):
    problems, _ = check_page(fake_page(tmp_path, **change), tmp_path)
    assert any(why in p for p in problems), problems


def test_an_unmarked_command_that_cannot_run_fails(tmp_path):
    page = tmp_path / "fake.md"
    page.write_text(
        "```bash\npython -m verl_modal --backend modal --gpu H100:8 -- trainer.total_epochs=1\n```\n"
    )
    problems, _ = check_page(page, tmp_path)
    assert len(problems) == 1 and "no Modal credentials" in problems[0], problems
    page.write_text("<!-- doc-check: expensive -->\n" + page.read_text())
    assert check_page(page, tmp_path) == ([], 0)


def test_an_unlabeled_block_that_starts_with_a_command_is_a_command():
    block = Block(Path("x.md"), 1, "", "python -m modal_rl.cluster smoke --nodes 3\n")
    assert block.is_command and not Block(Path("x.md"), 1, "text", block.text).is_command
