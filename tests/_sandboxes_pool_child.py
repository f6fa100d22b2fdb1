"""Child process for the teardown tests: runs a pool, prints its sandbox PIDs, then idles.

argv: registry_dir run_id mode   (mode: "signals" installs the pool's SIGINT/SIGTERM teardown;
"abandon" returns from ``asyncio.run`` with the pool never closed, as a careless caller would)
"""

import asyncio
import json
import sys
import time

from modal_rl.sandboxes import LocalProvider, SandboxPool, SandboxSpec


async def main(registry_dir: str, run_id: str, mode: str) -> None:
    pool = SandboxPool(
        LocalProvider(registry_dir=registry_dir),
        SandboxSpec(timeout_s=120),
        min_warm=3,
        run_id=run_id,
        rate_limiter=False,
        log_interval_s=0,
        handle_signals=mode == "signals",
    )
    if mode == "abandon":
        await pool.start()
        while pool.snapshot()["warm"] < 3:
            await asyncio.sleep(0.02)
        await pool.acquire()
        print(json.dumps({"pids": [h.pid for h in pool._all.values()]}), flush=True)
        sys.stdin.readline()  # the test has seen them alive
        return  # asyncio.run now cancels the pool's tasks and closes the loop
    async with pool:
        while pool.snapshot()["warm"] < 3:
            await asyncio.sleep(0.02)
        leased = await pool.acquire()
        print(json.dumps({"pids": [h.pid for h in pool._all.values()], "leased": leased.id}), flush=True)
        if mode == "hang":
            time.sleep(3600)  # a wedged run: the event loop is stuck, only a sweep can help
        await asyncio.sleep(3600)


asyncio.run(main(*sys.argv[1:4]))
