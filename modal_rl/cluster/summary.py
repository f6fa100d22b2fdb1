"""A dry run's plan as a short summary: what a user checks before spending a queue wait.

The whole plan (``--json``) holds every field, the composed command line included; the
summary keeps one line per decision (cluster shape and RDMA, image and its pins, Volumes,
entry point, env, adapter sections), each cut to :data:`WIDTH` characters, at most
:data:`MAX_LINES` lines. The command line is shown once, its head and how many arguments
follow.
"""

from __future__ import annotations

import shlex
from typing import Any

MAX_LINES = 40
WIDTH = 160
# Plan keys the summary shows on its own lines (the rest of the core plan is in --json).
CORE_KEYS = {
    "backend",
    "spec",
    "image",
    "modal_function",
    "local_files",
    "packages",
    "commands",
    "env",
    "ray_auth",
    "dashboard",
    "entrypoint",
    "runtime_env",
    "framework_argv",
    "preflight",
}


def _cut(text: str, width: int = WIDTH) -> str:
    indent = str(text)[: len(str(text)) - len(str(text).lstrip())]
    text = indent + " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _wrapped(label: str, items: list[str], width: int = WIDTH) -> list[str]:
    """``label`` then ``items`` joined by ", ", on as many lines as they need (none is cut)."""
    lines, current = [], label
    for i, item in enumerate(items):
        piece = item + ("," if i < len(items) - 1 else "")
        if len(current) + 1 + len(piece) > width and current.strip() != label.strip():
            lines.append(current)
            current = " " * 4
        current += (" " if current.strip() else "") + piece
    return [*lines, current]


def _value(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={_value(v)}" for k, v in value.items()) or "{}"
    if isinstance(value, list | tuple):
        head = ", ".join(_value(v) for v in value[:4])
        return f"[{head}{', ...' if len(value) > 4 else ''}] ({len(value)})" if value else "[]"
    return str(value)


def _image(image: Any) -> list[str]:
    if not isinstance(image, dict):
        return [f"image: {image}"]
    pinned = image.get("pinned", {})
    lines = [
        f"image: {image.get('base')} + python {image.get('python')} + {image.get('framework')} + modal-rl"
    ]
    lines += _wrapped("  pinned:", [f"{k}=={v}" for k, v in pinned.items()])
    for extra, why in (image.get("chosen_by") or {}).items():
        lines.append(f"  extra {extra}: from {why}")
    if image.get("build_commands"):
        lines.append(f"  then: {len(image['build_commands'])} build command(s) (patch series)")
    return lines


def _command(argv: list[str]) -> str:
    head = argv[:4]
    rest = len(argv) - len(head)
    return shlex.join(head) + (f" ... (+{rest} args)" if rest > 0 else "")


def render(plan: dict[str, Any]) -> str:
    """The summary text of a dry-run plan (see the module doc)."""
    spec = plan.get("spec", {})
    fn = plan.get("modal_function", {})
    lines = [
        f"plan ({plan.get('backend')}): {spec.get('nodes')} node(s) x {fn.get('gpu') or spec.get('gpu')}, "
        f"RDMA {'on' if spec.get('rdma') else 'off'}, timeout {fn.get('timeout')} s, retries {spec.get('retries')}",
        *_image(plan.get("image")),
    ]
    volumes = spec.get("volumes") or {}
    lines.append("volumes: " + (", ".join(f"{n}:{p}" for n, p in volumes.items()) or "none"))
    if spec.get("secrets"):
        lines.append("secrets: " + ", ".join(spec["secrets"]))
    files = (plan.get("local_files") or {}).get("files") or []
    if files:
        total = (plan.get("local_files") or {}).get("total_bytes", 0)
        lines.append(
            f"local files shipped: {len(files)} ({total} bytes): " + ", ".join(f["path"] for f in files)
        )
    if spec.get("env"):
        lines.append("env: " + ", ".join(f"{k}={v}" for k, v in spec["env"].items()))
    lines.append(f"job: {_command(list(plan.get('entrypoint') or []))}")
    env_vars = (plan.get("runtime_env") or {}).get("env_vars") or {}
    if env_vars:
        lines.append("job env: " + ", ".join(sorted(env_vars)))
    lines.append(f"ray auth: {plan.get('ray_auth')}; dashboard: {plan.get('dashboard')}")
    for name, section in plan.items():
        if name in CORE_KEYS or section in (None, {}, []):
            continue
        if isinstance(section, dict):
            lines.append(f"{name}:")
            lines += [
                f"  {key}: {_value(value)}" for key, value in section.items() if value not in (None, {}, [])
            ]
        else:
            lines.append(f"{name}: {_value(section)}")
    lines.append(f"preflight: {plan.get('preflight', 'ok')} (--json prints the whole plan)")
    lines = [_cut(line) for line in lines]
    if len(lines) > MAX_LINES:
        lines = [*lines[: MAX_LINES - 2], f"... {len(lines) - MAX_LINES + 1} more line(s)", lines[-1]]
    return "\n".join(lines) + "\n"
