"""Every ``MODAL_RL_*`` environment variable, declared once: its type, default, reader and meaning.

A launcher hands settings to the processes it starts (Ray workers, engine containers, sandboxes,
slime's own processes) through their environment, so the environment stays the carrier; what
this module adds is one place that knows every variable. ``read(name)`` parses a variable the
way its declaration says and turns a bad value into one line naming the variable, the value and
the fix (``SettingsError``), so a typo in a timeout never becomes a traceback deep inside a run.

Invariants:
- every ``MODAL_RL_*`` variable the code reads is in ``VARIABLES`` (a test scans the source);
  docs/settings.md lists each of them (the same test compares);
- ``read`` looks at the environment on every call (no cache), so a test, a relaunch or a child
  process that sets a variable sees it where the code reads it;
- secrets (``kind="secret"``) are read as text and never echoed in an error.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KINDS = ("text", "secret", "path", "int", "float", "flag")


class SettingsError(ValueError):
    """A ``MODAL_RL_*`` variable holds a value its declaration refuses (one line)."""


@dataclass(frozen=True)
class Variable:
    name: str
    kind: str
    default: Any
    read_by: str
    meaning: str

    def __post_init__(self) -> None:
        if not self.name.startswith("MODAL_RL_") or self.kind not in KINDS:
            raise ValueError(f"bad declaration {self.name!r} ({self.kind!r}): MODAL_RL_* and one of {KINDS}")


def _v(name: str, kind: str, default: Any, read_by: str, meaning: str) -> tuple[str, Variable]:
    return name, Variable(name, kind, default, read_by, meaning)


VARIABLES: dict[str, Variable] = dict(
    [
        # keys and identity (modal_rl.run_key, docs/security.md)
        _v("MODAL_RL_RUN_KEY", "secret", None, "modal_rl.run_key", "the run key; trainer side only"),
        _v("MODAL_RL_ENGINE_BEARER", "secret", None, "modal_rl.run_key", "the engines' bearer token"),
        _v("MODAL_RL_FRAME_READ_KEY", "secret", None, "modal_rl.run_key", "a receiver's frame-read key"),
        _v("MODAL_RL_RUN_ID", "text", None, "modal_rl.cluster.procs", "the run's id: tags its processes"),
        # clusters
        _v(
            "MODAL_RL_RAY_AUTH",
            "text",
            None,
            "modal_rl.cluster.plan",
            "`token` turns Ray's token auth on locally",
        ),
        _v(
            "MODAL_RL_COLLECTIVE",
            "text",
            None,
            "modal_rl.cluster.collective",
            "set by the collective check's child",
        ),
        _v("MODAL_RL_VOLUMES", "text", None, "modal_rl.weightsync.transport.volumes", "Volume mounts, JSON"),
        _v("MODAL_RL_NODE_ID", "text", None, "modal_rl.weightsync.transport.volumes", "this node's id"),
        _v(
            "MODAL_RL_NODE_STATE_DIR",
            "path",
            None,
            "modal_rl.weightsync.transport.volumes",
            "node-local state",
        ),
        # runs, logs, reports
        _v("MODAL_RL_DEBUG", "flag", False, "modal_rl.cli_errors", "`1`: errors keep their traceback"),
        _v(
            "MODAL_RL_PROGRESS",
            "text",
            None,
            "modal_rl.progress",
            "`1`: progress lines off a terminal; `0`: none",
        ),
        _v("MODAL_RL_KEEP_LOGS", "flag", False, "modal_rl.run_temp", "`1`: keep a run's logs"),
        _v(
            "MODAL_RL_TEMP_BASE",
            "path",
            None,
            "modal_rl.run_temp",
            "set for a run's processes: where they make run dirs when TMPDIR is too long",
        ),
        _v("MODAL_RL_RUN_PARTS_DIR", "path", None, "modal_rl.report.parts", "where a run's parts write"),
        _v(
            "MODAL_RL_RUN_DIR",
            "path",
            None,
            "modal_rl.cluster.run_folder",
            "set by the launcher: the cluster run's report folder",
        ),
        _v(
            "MODAL_RL_RUN_COMMAND",
            "text",
            None,
            "modal_rl.cluster.run_folder",
            "set by the launcher: the command line the report shows",
        ),
        # engines and weight sync
        _v(
            "MODAL_RL_VLLM_PLAIN_WEIGHTS",
            "flag",
            False,
            "modal_rl.weightsync.apply.vllm_inplace",
            "plain CPU linears",
        ),
        _v(
            "MODAL_RL_LORA_DIR",
            "path",
            None,
            "modal_rl.weightsync.apply.adapter_dir",
            "LoRA staging directory",
        ),
        _v(
            "MODAL_RL_SGLANG_WEIGHT_DIRS",
            "text",
            None,
            "modal_rl.engines.sglang_paths",
            "an SGLang engine's weight directories, JSON",
        ),
        _v(
            "MODAL_RL_COLOCATED_SYNC", "text", "inplace", "verl_modal.colocated_sync", "`inplace` or `reload`"
        ),
        # sandboxes and rewards
        _v("MODAL_RL_SANDBOX_BACKEND", "text", "local", "modal_rl.sandboxes.shared", "`local` or `modal`"),
        _v("MODAL_RL_SANDBOX_IMAGE", "text", None, "modal_rl.sandboxes.shared", "the sandboxes' image"),
        _v("MODAL_RL_SANDBOX_MIN_WARM", "int", 2, "modal_rl.sandboxes.shared", "sandboxes kept warm"),
        _v("MODAL_RL_SANDBOX_MAX_LIVE", "int", 64, "modal_rl.sandboxes.shared", "most sandboxes at once"),
        _v("MODAL_RL_SANDBOX_MEMORY_MB", "int", 1024, "modal_rl.sandboxes.shared", "memory per sandbox"),
        _v("MODAL_RL_SANDBOX_NETWORK", "flag", False, "modal_rl.sandboxes.shared", "`1`: outbound network"),
        _v(
            "MODAL_RL_SANDBOX_APP",
            "text",
            "modal-rl-sandboxes",
            "modal_rl.sandboxes.shared",
            "Modal app name",
        ),
        _v(
            "MODAL_RL_SANDBOX_REGISTRY",
            "path",
            None,
            "modal_rl.sandboxes.live_records",
            "live-sandbox records",
        ),
        _v(
            "MODAL_RL_SANDBOX_METRICS_DIR", "path", None, "verl_modal.reward_manager", "pool metrics per step"
        ),
        _v("MODAL_RL_REWARD_TIMEOUT_S", "float", 10.0, "slime_modal.config", "seconds per reward run"),
        _v("MODAL_RL_REWARD_PARTIAL", "flag", False, "slime_modal.config", "`1`: partial credit"),
        # slime
        _v("MODAL_RL_SLIME_ENGINES", "text", None, "slime_modal.manager_seam", "the engines' config, JSON"),
        _v(
            "MODAL_RL_SLIME_RECOVER_TIMEOUT_S",
            "float",
            1800.0,
            "slime_modal.rollout_manager",
            "engine recovery",
        ),
        _v("MODAL_RL_PRE_READ_TIMEOUT_S", "float", 120.0, "slime_modal.weight_hooks", "wait for a version"),
        _v("MODAL_RL_SLIME_CPU", "flag", False, "slime_modal.cpu.activate", "`1`: slime's CPU mode"),
        _v("MODAL_RL_SLIME_CPU_VISIBLE_DEVICES", "text", None, "slime_modal.cpu.accelerator", "CPU devices"),
        _v(
            "MODAL_RL_SLIME_CHECK_ARGS",
            "text",
            None,
            "scripts/main_slime.sh",
            "arguments for the run's summary check",
        ),
        _v("MODAL_RL_SLIME_RUN_DIR", "path", None, "scripts/main_slime.sh", "the slime main job's directory"),
        _v(
            "MODAL_RL_SLIME_ENTRY",
            "text",
            None,
            "scripts/main_slime.sh, slime_modal.async_numbers",
            "slime's entry script (the launcher sets it in the job)",
        ),
        _v("MODAL_RL_SLIME_SRC", "path", None, "scripts/install_slime_cpu.sh", "a slime checkout"),
        _v("MODAL_RL_SLIME_REPO", "text", None, "scripts/install_slime_cpu.sh", "slime's git URL"),
        _v("MODAL_RL_MEGATRON_REPO", "text", None, "scripts/install_slime_cpu.sh", "Megatron-LM's git URL"),
        _v("MODAL_RL_SLIME_VENV", "path", None, "scripts/install_slime_cpu.sh", "slime's venv"),
        # installs
        _v("MODAL_RL_VENV", "path", None, "scripts/_venv.sh", "the project venv (default .venv/)"),
        _v("MODAL_RL_INSTALLER", "text", "uv", "scripts/_venv.sh", "`uv` or `pip`"),
    ]
)

# Names that look like variables but are markers the trusted test runner prints or reads
# inside a sandbox (modal_rl.sandboxes), or prefixes of the families above.
NOT_VARIABLES = frozenset(
    {
        "MODAL_RL_UNIT",
        "MODAL_RL_DONE",
        "MODAL_RL_TOTAL",
        "MODAL_RL_NOTE",
        "MODAL_RL_INFRA",
        "MODAL_RL_DECIDES",
        "MODAL_RL_BADTESTS",
        "MODAL_RL_FIRST_OUTPUT",
        "MODAL_RL_SANDBOX_",
        "MODAL_RL_REWARD_",
    }
)

_FLAG = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}


def read(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of ``name`` from ``environ`` (default ``os.environ``), parsed as declared; the
    declared default when unset or empty. A bad value raises ``SettingsError`` in one line."""
    var = VARIABLES.get(name)
    if var is None:
        raise KeyError(f"{name} is not a declared modal-rl setting (modal_rl/settings.py)")
    raw = (os.environ if environ is None else environ).get(name, "")
    if raw == "":
        return var.default
    shown = "<secret>" if var.kind == "secret" else repr(raw)
    try:
        if var.kind == "int":
            return int(raw)
        if var.kind == "float":
            value = float(raw)
            if not value > 0:
                raise ValueError
            return value
        if var.kind == "flag":
            return _FLAG[raw.strip().lower()]
    except (ValueError, KeyError):
        want = {"int": "a whole number", "float": "a number > 0", "flag": "1 or 0"}[var.kind]
        raise SettingsError(f"{name}={shown}: give {want} ({var.meaning}), or unset it") from None
    return raw
