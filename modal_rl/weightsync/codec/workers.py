"""The codec's worker threads: started once per process and thread count, shared by every
encode and apply.

A frame is a few hundred short tasks. A pool made per frame put thread start-up, and the
GIL hand-offs it needs, in front of the first chunks: on a 23M-word model the second
worker began 5–10 ms into a 25–45 ms apply. These pools start all their threads at once
and live for the process (their idle threads are joined at exit); a forked child gets
pools of its own.

Invariant: no task waits for another task (a shared pool whose workers all waited would
never finish); tasks compute, and only callers wait on futures. The one exception is the
start itself: exactly ``threads`` tasks meet at a barrier in a new pool of ``threads``.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_pools: dict[tuple[int, int], ThreadPoolExecutor] = {}
_lock = threading.Lock()
START_TIMEOUT_S = 10.0


def shared_pool(threads: int) -> ThreadPoolExecutor:
    """This process's pool of ``threads`` workers, all of them running."""
    key = (os.getpid(), threads)
    with _lock:
        pool = _pools.get(key)
        if pool is None:
            pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"weightsync{threads}")
            _start_all(pool, threads)
            _pools[key] = pool
    return pool


def _start_all(pool: ThreadPoolExecutor, threads: int) -> None:
    # A ThreadPoolExecutor starts a thread only when no worker is idle: tasks that wait for
    # each other at a barrier keep every worker busy until the last one exists.
    barrier = threading.Barrier(threads)
    started = [pool.submit(barrier.wait, START_TIMEOUT_S) for _ in range(threads)]
    for future in started:
        future.result()
