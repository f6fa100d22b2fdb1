"""Load the codec's compiled kernels before the first frame needs them.

The v2 chunk coding, the diff, the sparse scatter, the ``RANS0`` streams and the checksums
(``linsum``) are numba kernels (``cache=True``): the first call in a process imports numba, loads (or compiles) each
kernel for the argument types it sees, and starts the worker pool. On a fresh receiver that
cost 0.5–0.6 s and landed on its first delta (the steady deltas take 0.05–0.07 s on the same
host). ``start_warm_up``
pays it on a background thread when a ``Subscriber`` or ``Publisher`` is made — while the
receiver connects and its anchor is on the wire, before an engine replacement takes
traffic — by coding and decoding one small synthetic chunk through the same functions,
with the same argument types, as real frames use.

Invariant: warming up touches no caller state and never raises; a process without numba
just skips it (its frames fall back to v1, see ``chunks_v2.available``).
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np

log = logging.getLogger(__name__)

_lock = threading.Lock()
_started: threading.Thread | None = None
_done = threading.Event()
_measuring = False  # decode costs measured, or being measured, in this process


def warm_up(threads: int | None = None, measure_costs: bool = False) -> bool:
    """Run every kernel once (synchronously); True when they are loaded. ``threads``: also
    start the codec's shared worker pool of that size; ``measure_costs``: then measure this
    CPU's v2 decode costs for the hello (receivers only, ``decode_costs``)."""
    try:
        if threads is not None:
            from modal_rl.weightsync.codec.workers import shared_pool

            shared_pool(threads)
        from modal_rl.weightsync.codec import fused, linsum
        from modal_rl.weightsync.codec.codings import chunks_v2
        from modal_rl.weightsync.codec.diffwords import diff_and_move, diff_words
        from modal_rl.weightsync.codec.scatter import scatter

        words = 1 << 14
        rng = np.random.default_rng(0)
        for dtype in (np.uint16, np.uint32, np.uint8, np.uint64):
            held = np.zeros(8, dtype)
            scatter(held, np.arange(0, 8, 2, dtype=np.int64), 0, np.ones(4, dtype), "add")
            diff_words(held, held + dtype(1))  # the publisher's diff (and a relay's)
            # the checksums: full, the publisher's fused diff, a receiver's moves (both ops)
            changed = np.arange(0, 8, 2, dtype=np.int64)
            linsum.full_sum(held)
            linsum.delta_sum(held, changed, held[changed])
            diff_and_move(held, held + dtype(1), 0)
            pieces = [(held.copy(), held + dtype(1), 0, 8, 0)]  # the publisher's chunk pass
            fused.write_changed(pieces, *fused.diff_chunk(pieces, 8, True)[0:3:2])
            fused.apply_sparse([(0, held)], 0, changed, np.ones(4, dtype), True)  # a receiver's chunk pass
            # the layouts' table forms (``buckets``, ``held_layout``)
            fused.gather_table(
                np.array([held.ctypes.data], np.int64), np.array([8]), np.array([0]), held.copy()
            )
            table = (np.array([held.ctypes.data], np.int64), np.array([8]), np.array([0]), held.dtype)
            fused.apply_table(table, 0, changed, np.ones(4, dtype), True)
            for xor in (True, False):
                linsum.moved_by_residuals(held, changed, 0, np.ones(4, dtype), xor)
        from modal_rl.weightsync.codec import rans0

        plane = (np.arange(4096) % 3).astype(np.uint8)  # a v1 sparse chunk's noisy plane (``RANS0``)
        if rans0.decode(rans0.encode(plane), plane.size) is None:
            log.warning("weight-sync warm-up could not decode its rans0 stream")
            return False
        if not chunks_v2.available():
            return False
        base = (rng.integers(0x3A00, 0x3F00, words, dtype=np.int64)).astype(np.uint16)
        new = base.copy()
        new[::97] += np.uint16(1)
        half = words // 2
        from modal_rl.weightsync.codec.codings.chunks import CHUNK_HEADER, CTX_SPARSE

        def header(nchanged: int) -> bytes:
            return CHUNK_HEADER.pack(0, words, nchanged, CTX_SPARSE, chunks_v2.CTX_STREAMS)

        body, _, _, _ = chunks_v2.encode(
            header, [base[:half], base[half:]], [new[:half], new[half:]], [0, half], 1
        )
        held16 = base.copy()
        nchanged = int(np.count_nonzero(base != new))
        chunks_v2.decode(memoryview(body), 0, words, nchanged, [held16[:half], held16[half:]], [0, half])
        if not np.array_equal(held16, new):
            log.warning("weight-sync warm-up decoded other words than it coded")
            return False
        # the refusal path (put back what a corrupt chunk wrote) uses the "set" scatter
        chunks_v2._put_back([held16], [0], np.arange(0, 4, dtype=np.int64), base[:4].copy())
        if measure_costs:
            from modal_rl.weightsync.codec.decode_probe import measure

            measure()  # ~40 ms, once per receiving process
        return True
    except Exception as exc:  # never fail the caller: the kernels then load on first use
        log.info("weight-sync warm-up skipped: %s", exc)
        return False
    finally:
        _done.set()


def _measure_when_warm() -> None:
    _done.wait()
    try:
        from modal_rl.weightsync.codec.decode_probe import measure

        measure()
    except Exception as exc:  # the hello then names no costs: the server's defaults apply
        log.info("weight-sync decode costs not measured: %s", exc)


def _forget_in_child() -> None:
    # a forked child has no warm-up thread (nor, maybe, the kernels): it starts its own
    global _started, _done, _measuring
    _started, _done, _measuring = None, threading.Event(), False


os.register_at_fork(after_in_child=_forget_in_child)


def start_warm_up(threads: int | None = None, measure_costs: bool = False) -> threading.Thread:
    """``warm_up`` on a daemon thread, once per process; returns that thread. A receiver
    asks for ``measure_costs``; in a process whose warm-up a publisher already started, the
    measurement follows it on a thread of its own."""
    global _started, _measuring
    with _lock:
        if _started is None:
            _started = threading.Thread(
                target=warm_up, args=(threads, measure_costs), name="weightsync-warm-up", daemon=True
            )
            _started.start()
            _measuring = measure_costs
        elif measure_costs and not _measuring:
            _measuring = True
            threading.Thread(target=_measure_when_warm, name="weightsync-decode-costs", daemon=True).start()
        return _started


def wait_warm(timeout: float | None = None) -> bool:
    """Wait until a started warm-up finished (True), or ``timeout`` passed."""
    return _done.wait(timeout)
