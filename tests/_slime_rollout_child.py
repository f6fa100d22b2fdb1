"""Child process for the slime glue exit test: a rollout process as slime runs one.

slime runs rewards on one daemon event-loop thread per process (slime.utils.async_utils); this
child does the same, scores samples, prints its sandbox PIDs, and exits without closing anything.
The first atexit handler registered runs last: it reports whether the pool was closed by then.
"""

import asyncio
import atexit
import json
import sys
import threading
from types import SimpleNamespace

state = {}
atexit.register(lambda: print(json.dumps({"closed_at_exit": state["pool"]._closed}), flush=True))

from slime_modal.config import rollout_pool  # noqa: E402
from slime_modal.reward import batched_reward_func  # noqa: E402

loop = asyncio.new_event_loop()
threading.Thread(target=loop.run_forever, daemon=True).start()

args = SimpleNamespace(modal_rl_sandbox={"min_warm": 2, "max_live": 4})
samples = [
    SimpleNamespace(index=i, response="print(7)", label="7", metadata={}, remove_sample=False) for i in (0, 1)
]


async def main():
    rewards = await batched_reward_func(args, samples)
    pool = state["pool"] = await rollout_pool(args)
    while pool.snapshot()["warm"] < 2:
        await asyncio.sleep(0.02)
    return rewards, [h.pid for h in pool._all.values()]


rewards, pids = asyncio.run_coroutine_threadsafe(main(), loop).result(60)
print(json.dumps({"rewards": rewards, "pids": pids}), flush=True)
sys.exit(0)
