"""Where an engine stages LoRA adapters, and which adapter names are safe there.

Both sides use it: the engine's workers write an adapter version to ``adapter_root()/<name>``
(``vllm_lora``), and the engine guard (``modal_rl.engines.routes``) lets vLLM load an adapter
only from that directory by one such name. It lives in weight sync, which the engine side
imports, so that weight sync needs nothing from the engine side.

Invariants: ``adapter_name`` returns its argument unchanged or raises ``ValueError`` of one
line naming the rule; a safe name is one path component (no separator, no leading dot, no
``..``, at most 128 characters); ``adapter_root`` reads ``MODAL_RL_LORA_DIR`` on each call.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

ADAPTER_DIR_ENV = "MODAL_RL_LORA_DIR"  # the engine's LoRA staging directory
# One path component: no separator, no leading dot (so no "." or ".."), bounded.
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def adapter_name(name: object) -> str:
    """``name`` if it is one safe path component; ``ValueError`` naming the rule otherwise."""
    if not isinstance(name, str) or not SAFE_NAME.fullmatch(name) or ".." in name:
        raise ValueError(
            f"adapter name {show(name)}: use one path component of letters, digits, '_', '.', '-' "
            "(no '/', no leading '.', no '..', at most 128 characters)"
        )
    return name


def adapter_root() -> Path:
    """The engine's LoRA staging directory: ``MODAL_RL_LORA_DIR``, else ``modal_rl-lora`` in
    the engine's own temp dir (its pool gives each engine one). The API server and the
    workers share the environment, so both name the same directory."""
    given = os.environ.get(ADAPTER_DIR_ENV)
    return Path(given) if given else Path(tempfile.gettempdir()) / "modal_rl-lora"


def show(value: object) -> str:
    """``value`` as a short, terminal-safe repr for an error line."""
    from modal_rl.text_safety import clean

    return repr(clean(str(value)[:80]))
