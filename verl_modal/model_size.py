"""How big the run's model is, from its checkpoint's headers: what a full-weights sync sends.

Shared by the console's summary and the per-step metrics (``step_metrics``), which is why it is
a module of its own: neither imports the other.
"""

from __future__ import annotations

import json
from pathlib import Path


def checkpoint_numel(model_dir: Path) -> int | None:
    """Parameters in a safetensors checkpoint, from its headers (no tensor is read)."""
    import math
    import struct

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total


_DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


def full_weights_mib(config) -> float | None:
    """What verl's ``naive`` sync sends each time, in MiB (the unit of every sync number we
    show: console, report, tensorboard): every parameter in the actor's dtype."""
    from omegaconf import OmegaConf

    model = Path(str(OmegaConf.select(config, "actor_rollout_ref.model.path", default=""))).expanduser()
    dtype = str(OmegaConf.select(config, "actor_rollout_ref.actor.fsdp_config.model_dtype", default="fp32"))
    try:
        numel = checkpoint_numel(model)
    except (OSError, ValueError, KeyError):
        return None
    return None if numel is None else numel * _DTYPE_BYTES.get(dtype, 4) / (1 << 20)
