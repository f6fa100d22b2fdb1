"""The collective transport (``transport.collective``): frames broadcast over a real gloo
process group of four processes on 127.0.0.1 -- a publisher and three receivers, one with the
run key, one with another key, one keyless.

The trajectory has both failures a collective must survive: a frame the publisher gives up
part way (receivers roll it back; the publisher's next frame is an anchor) and a chunk record
damaged after signing (refused; the receiver cannot ask again, so it skips the deltas it
cannot use and takes the next anchor). No receiver stalls the group: the run ends.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from modal_rl.run_key import RUN_KEY_ENV, new_run_key
from modal_rl.weightsync.transport.collective import MAX_HEADER_BYTES, _peek_header, _split, _usable
from modal_rl.weightsync.wire.frames import VersionHeader

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_source_skips_exactly_the_frames_a_frame_server_would_not_send():
    anchor = VersionHeader("anchor", 5, None, epoch=7)
    delta = VersionHeader("delta", 6, 5, epoch=7)
    assert _usable(anchor, None, None) and not _usable(delta, None, None)  # fresh: anchors only
    assert _usable(delta, 5, 7) and not _usable(delta, 4, 7) and not _usable(delta, 5, 8)
    assert not _usable(anchor, 5, 7) and _usable(anchor, 4, 7) and _usable(anchor, 9, 6)  # newer epoch
    assert not _usable(VersionHeader("anchor", 9, None, epoch=6), 5, 7)  # an older epoch's
    assert _usable(None, 5, 7)  # unparsable: handed on, for the chain to refuse by name
    record = anchor.to_record()
    assert _peek_header(record) == anchor
    assert _peek_header(record[:20]) is None and _peek_header(b"V" + bytes(MAX_HEADER_BYTES)) is None


def test_a_block_splits_into_its_whole_records_or_not_at_all():
    records = [VersionHeader("anchor", v, None, epoch=7).to_record() for v in range(3)]
    assert _split(b"".join(records)) == records
    assert _split(b"".join(records)[:-1]) is None  # the last record runs past the block
    assert _split(b"".join(records) + b"V") is None  # a header cut short


@pytest.mark.slow  # four processes that each import torch
@pytest.mark.timeout(180)
def test_a_collective_group_delivers_signed_frames_and_survives_a_cut_and_a_damaged_frame():
    key = new_run_key()
    keys = [key, key, new_run_key(), None]  # publisher; the run's receiver; another key; no key
    env = {k: v for k, v in os.environ.items() if k != RUN_KEY_ENV}
    env["PYTHONPATH"] = str(ROOT)
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.collective_procs", str(rank), "4", str(port), json.dumps(keys)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(4)
    ]
    results = {}
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=150)
            assert proc.returncode == 0, err[-3000:]
            line = json.loads(out.strip().splitlines()[-1])
            results[line["rank"]] = line
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    # The publisher: v2 given up part way, then re-sent as an anchor; anchors every 3 versions.
    assert results[0]["kinds"] == [
        "anchor",
        "delta",
        "given up",
        "anchor",
        "delta",
        "delta",
        "anchor",
        "delta",
    ]

    run = results[1]
    # v2's cut frame was rolled back (not a refusal), its anchor taken; v3's damaged record
    # refused; v4 (a delta on v3) skipped; the v5 anchor and v6 delta taken.
    assert run["activated"] == [0, 1, 2, 5, 6], run
    assert len(run["refused"]) == 1 and "C record" in run["refused"][0], run
    assert run["skipped"] >= 1 and run["exact"] is True

    for rank in (2, 3):  # another run's key, and none: every frame refused, nothing activated
        other = results[rank]
        assert other["activated"] == [] and other["exact"] is False, other
        assert len(other["refused"]) >= 3, other  # the anchors it could use: v0, v2, v5
