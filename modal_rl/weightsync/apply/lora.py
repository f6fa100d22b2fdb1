"""LoRA adapter-only weight sync: which tensors travel, what the engine calls each version,
and how many versions it keeps.

When a trainer trains a LoRA adapter on a frozen base, only the adapter changes between
versions, so only the adapter is published: :func:`adapter_state` keeps the ``lora_A`` /
``lora_B`` (and ``lora_embedding_A/B``) tensors of a ``(name, tensor)`` stream under their
PEFT names and drops the rest. Those tensors go through the ordinary ``Publisher`` /
``Subscriber`` frames -- anchors and deltas, the same keys, checksums and epochs -- and the
engine loads each verified version as a LoRA adapter (vLLM's ``--enable-lora`` path); the
base weights the engine loaded from the model path are never touched.

Versions and residency (:class:`AdapterVersions`): version N is served under the name
``<prefix>-v<N>``, so a request names the policy version it samples from, and an async run
can keep serving version N (its requests in flight) while N+1 is loaded. At most
``max_resident`` versions are resident; they occupy vLLM LoRA ids ``1..max_resident`` as a
ring: a new version takes the id of the oldest resident one and is loaded into it in place
(``LoRARequest(load_inplace=True)``: vLLM replaces that id's tensors, same shapes, no new
slot), which evicts the oldest version. TRL's rule ``max_loras >= staleness + 1`` becomes
``max_resident >= max_staleness + 1`` here (:func:`resident_for_staleness`): a request may
still be generating on a version up to ``max_staleness`` behind the newest, and the newest
itself is resident, so ``max_staleness + 1`` versions must be; vLLM's ``--max-loras`` (its
slots for one batch) must be at least that too, and ``--max-cpu-loras`` at least that.
Staging N+1 takes no vLLM slot (it lives in the subscriber's chain until it is verified).

Invariants:
- a version is loaded only after the subscriber verified it (it is the ``activate`` step);
  a load that fails leaves the resident set as it was (the evicted version's files are
  removed only after the new version loaded) and the engine serving what it served;
- versions are admitted in increasing (epoch, version) order; an older one is refused;
- an adapter's files are written whole under a temporary name and renamed, so the engine
  never reads a half-written adapter.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ADAPTER_MARKERS = (".lora_A.", ".lora_B.", ".lora_embedding_A", ".lora_embedding_B")
DEFAULT_PREFIX = "policy"
ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def is_adapter_tensor(name: str) -> bool:
    """True for a LoRA adapter tensor's name (PEFT's ``lora_A`` / ``lora_B`` / embeddings)."""
    return any(marker in name for marker in ADAPTER_MARKERS)


def peft_name(name: str, adapter: str = "default") -> str:
    """``...q_proj.lora_A.default.weight`` (a PEFT module's parameter name) -> the saved name
    ``...q_proj.lora_A.weight`` that adapter files and vLLM's loader use."""
    return name.replace(f".{adapter}.", ".") if is_adapter_tensor(name) else name


def adapter_state(named: Iterable[tuple[str, Any]] | dict, dtype: Any = None) -> tuple[dict[str, Any], int]:
    """The adapter tensors of a ``(name, tensor)`` stream (or dict), under their saved PEFT
    names, and how many other tensors were dropped. Raises ``ValueError`` when there is no
    adapter tensor at all (the trainer is not training LoRA: sync full weights instead).

    ``dtype``: cast to it (the engine's LoRA dtype; vLLM's default is the model's). vLLM casts
    an adapter to that dtype when it loads it, so publishing it cast loses nothing the engine
    would serve, and halves what an fp32 adapter would put on the wire."""
    items = named.items() if isinstance(named, dict) else named
    kept: dict[str, Any] = {}
    dropped = 0
    for name, tensor in items:
        if is_adapter_tensor(name):
            kept[peft_name(name)] = tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)
        else:
            dropped += 1
    if not kept:
        raise ValueError(
            f"no LoRA adapter tensors (names with lora_A/lora_B) among {dropped} tensors: the trainer "
            "is not training a LoRA adapter; sync full weights instead (lora_rank=0)"
        )
    return kept, dropped


def adapter_config(rank: int, alpha: float, target_modules: Any, base_model: str = "") -> dict:
    """A PEFT ``adapter_config.json`` for a plain LoRA adapter (what vLLM reads beside the
    tensors). ``target_modules``: a list of module names, or PEFT's ``"all-linear"``."""
    if int(rank) <= 0:
        raise ValueError(f"LoRA rank must be > 0, got {rank}")
    targets = target_modules if isinstance(target_modules, str) else sorted(target_modules)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(rank),
        "lora_alpha": float(alpha),
        "target_modules": targets,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": str(base_model),
    }


def write_adapter(path: Path, tensors: dict[str, Any], config: dict) -> Path:
    """Write a PEFT adapter directory at ``path`` (replacing one there) atomically: into a
    temporary sibling, then renamed."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(
        {k: torch.as_tensor(v).detach().contiguous() for k, v in tensors.items()}, str(tmp / ADAPTER_FILE)
    )
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=1, sort_keys=True))
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)
    return path


def resident_for_staleness(max_staleness: int) -> int:
    """Adapter versions an engine must keep resident so that every request in flight still
    finds its own version: the newest plus ``max_staleness`` behind it (TRL's
    ``max_loras >= staleness + 1``; see the module docstring)."""
    if int(max_staleness) < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    return int(max_staleness) + 1


@dataclass(frozen=True)
class AdapterAdmission:
    """Where version ``version`` goes: its name, its vLLM LoRA id, whether it replaces the
    version that held that id (``inplace``), and that evicted version (None: a free id)."""

    version: int
    name: str
    lora_id: int
    inplace: bool
    evicted: int | None


@dataclass
class AdapterVersions:
    """The resident adapter versions of one engine: names, ids (a ring of ``max_resident``),
    eviction. Pure bookkeeping; :class:`AdapterLoader` does the loading."""

    max_resident: int = 2
    prefix: str = DEFAULT_PREFIX
    _resident: OrderedDict = field(default_factory=OrderedDict)  # version -> lora id, oldest first
    _last: tuple[int, int] | None = None  # (epoch, version) last admitted

    def __post_init__(self) -> None:
        if int(self.max_resident) < 1:
            raise ValueError(f"max_resident must be >= 1, got {self.max_resident}")
        from modal_rl.weightsync.apply.adapter_dir import adapter_name

        adapter_name(self.prefix)  # it names a directory on the engine: one safe component

    def name(self, version: int) -> str:
        return f"{self.prefix}-v{int(version)}"

    def plan(self, version: int, epoch: int = 0) -> AdapterAdmission:
        """Where ``version`` would go; nothing changes until :meth:`commit`. Raises
        ``ValueError`` for a version not newer than the last one admitted."""
        if self._last is not None and (epoch, version) <= self._last:
            raise ValueError(
                f"adapter version {version} (epoch {epoch:x}) is not newer than the resident "
                f"{self._last[1]} (epoch {self._last[0]:x})"
            )
        if version in self._resident:  # a new epoch reusing a number: replace it in place
            return AdapterAdmission(version, self.name(version), self._resident[version], True, version)
        if len(self._resident) < self.max_resident:
            used = set(self._resident.values())
            free = next(i for i in range(1, self.max_resident + 1) if i not in used)
            return AdapterAdmission(version, self.name(version), free, False, None)
        oldest, lora_id = next(iter(self._resident.items()))
        return AdapterAdmission(version, self.name(version), lora_id, True, oldest)

    def commit(self, admission: AdapterAdmission, epoch: int = 0) -> None:
        if admission.evicted is not None:
            self._resident.pop(admission.evicted, None)
        self._resident[admission.version] = admission.lora_id
        self._last = (epoch, admission.version)

    def resident(self) -> dict[int, int]:
        """Resident versions -> their LoRA ids, oldest first."""
        return dict(self._resident)

    @property
    def newest(self) -> int | None:
        return next(reversed(self._resident)) if self._resident else None


class AdapterLoader:
    """The ``activate`` of an adapter-only ``Subscriber``: each verified version is written as
    a PEFT adapter under ``root`` and loaded into an in-process ``engine`` (an object with
    vLLM's ``add_lora(LoRARequest)``, e.g. ``LLM.llm_engine``), in place into the id of the
    version it evicts. A vLLM server is loaded over HTTP instead (``vllm_lora``).

    ``config``: the adapter's ``adapter_config.json`` (:func:`adapter_config`). ``pauses``
    holds each load's seconds (the engine's loop runs the load between steps)."""

    def __init__(self, engine: Any, root: Path, config: dict, versions: AdapterVersions | None = None):
        self.engine = engine
        self.root = Path(root)
        self.config = dict(config)
        self.versions = versions or AdapterVersions()
        self.pauses: list[float] = []
        self.current = None  # the LoRARequest of the newest loaded version

    def path(self, version: int) -> Path:
        return self.root / self.versions.name(version)

    def request(self, version: int):
        """The ``LoRARequest`` that samples from resident ``version``."""
        from vllm.lora.request import LoRARequest

        lora_id = self.versions.resident().get(int(version))
        if lora_id is None:
            raise KeyError(f"adapter version {version} is not resident ({sorted(self.versions.resident())})")
        return LoRARequest(self.versions.name(version), lora_id, str(self.path(version)))

    def __call__(self, state: dict, version: int, epoch: int = 0) -> None:
        from vllm.lora.request import LoRARequest

        admission = self.versions.plan(int(version), epoch)
        tensors, _ = adapter_state(state)
        path = write_adapter(self.path(version), tensors, self.config)
        request = LoRARequest(admission.name, admission.lora_id, str(path), load_inplace=admission.inplace)
        t0 = time.perf_counter()
        try:
            ok = self.engine.add_lora(request)
        except BaseException:
            if admission.evicted != admission.version:
                shutil.rmtree(path, ignore_errors=True)
            raise
        self.pauses.append(time.perf_counter() - t0)
        if ok is False:
            shutil.rmtree(path, ignore_errors=True)
            raise RuntimeError(f"the engine did not load adapter {admission.name} (id {admission.lora_id})")
        self.versions.commit(admission, epoch)
        if admission.evicted is not None and admission.evicted != admission.version:
            shutil.rmtree(self.path(admission.evicted), ignore_errors=True)
        self.current = request
