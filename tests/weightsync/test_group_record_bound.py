"""A group record's entries have a declared-size bound (issue 50, item 7): an 8 KB record that
declares 65536 tensors and inflates to 256 MiB is refused having inflated at most the bound
(measured as the peak memory of a fresh process), and real group records still decode."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from modal_rl.weightsync.errors import CorruptFrameError
from modal_rl.weightsync.wire.frames import GROUP_HEADER, GroupHeader, TensorHeader

BOMB = r"""
import json, resource, sys, zstandard
from modal_rl.weightsync.errors import CorruptFrameError
from modal_rl.weightsync.wire.frames import GROUP_HEADER, GroupHeader
packer = zstandard.ZstdCompressor(level=3).compressobj()
zeros = b"\0" * (1 << 20)
packed = b"".join(packer.compress(zeros) for _ in range(256)) + packer.flush()
body = GROUP_HEADER.pack(65536, 1 << 20, 1, 65536) + packed
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    GroupHeader.from_body(body)
    verdict = "accepted"
except CorruptFrameError as exc:
    verdict = str(exc)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"record": len(body), "grew_mib": (after - before) / 1024, "verdict": verdict}))
"""


def test_a_small_record_cannot_inflate_hundreds_of_mib_before_it_is_refused():
    out = subprocess.run(
        [sys.executable, "-c", BOMB], capture_output=True, text=True, timeout=300, check=True
    )
    got = json.loads(out.stdout)
    assert got["record"] < 16 << 10  # the attack: a few KB on the wire
    assert got["verdict"] != "accepted"
    assert got["grew_mib"] < 32, got  # today's bound is 8 MiB of entries, not 256 MiB


def test_real_group_records_still_decode():
    tensors = tuple(
        TensorHeader(
            f"model.layers.{i}.mlp.experts.{i % 128}.down_proj.weight", "bfloat16", (64, 8), "ab" * 16
        )
        for i in range(2000)
    )
    header = GroupHeader(tensors, chunk_elems=2000 * 512, nchunks=1)
    assert GroupHeader.from_body(header.body()) == header


def test_a_record_whose_entries_pass_the_bound_is_refused():
    import zstandard

    body = GROUP_HEADER.pack(2, 1 << 20, 1, 2) + zstandard.ZstdCompressor().compress(b"\0" * 4096)
    with pytest.raises(CorruptFrameError, match="inflate past"):
        GroupHeader.from_body(body)
