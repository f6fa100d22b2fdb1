"""The runnable examples in docs/weight-sync.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "weight-sync.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_doc_has_one_example_per_transport():
    assert len(EXAMPLES) == 2
    assert "TcpSource" in EXAMPLES[0] and "DirectoryStore" in EXAMPLES[1]


@pytest.mark.parametrize("code", EXAMPLES, ids=["tcp", "store"])
def test_example_runs(code, capsys):
    exec(compile(code, str(DOC), "exec"), {})
    assert capsys.readouterr().out.strip()
