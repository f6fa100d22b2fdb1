"""What a sandbox's environment may hold: nothing that lets its code act as the run.

Code in a sandbox is untrusted (model-written programs, tool calls). It must never see the
run's key (it opens every endpoint of the run), Modal credentials (they open the user's
whole workspace) or the host's environment. Both providers build a sandbox's environment
from ``SandboxSpec.env`` and per-exec ``env`` only — the local one with ``bwrap --clearenv``,
the Modal one because a sandbox is a container of its own with no secrets attached — and
both pass those through ``check_env`` first, so a credential cannot be handed in by mistake
(e.g. ``env=dict(os.environ)``).

Refused: names that carry credentials (``CREDENTIAL_NAMES``, any ``MODAL_*`` or ``RAY_*``
name) and any value that contains a key this process holds (the run's key, or a part's
derived key: engine bearer, frame-read key, Ray token), whatever its name.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from modal_rl.run_key import SECRET_ENVS

CREDENTIAL_NAMES = frozenset({*SECRET_ENVS, "RAY_AUTH_TOKEN_PATH", "MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET"})
CREDENTIAL_PREFIXES = ("MODAL_", "RAY_")


class SandboxEnvError(ValueError):
    """A sandbox environment would have carried a credential."""


def check_env(env: Mapping[str, str] | None, where: str) -> dict[str, str]:
    """``env`` as a dict, or ``SandboxEnvError`` naming the first credential found (by name only)."""
    env = dict(env or {})
    # Whatever key this process holds (the run's, or only a part's derived ones): none may leak.
    keys = [os.environ[n] for n in SECRET_ENVS if len(os.environ.get(n, "")) >= 16]
    for name, value in env.items():
        if name in CREDENTIAL_NAMES or name.startswith(CREDENTIAL_PREFIXES):
            raise SandboxEnvError(
                f"{where}: {name} may not be passed into a sandbox (credentials and Modal/Ray "
                "settings stay outside it); drop it from the sandbox env"
            )
        if any(k in str(value) for k in keys):
            raise SandboxEnvError(
                f"{where}: the value of {name} holds a key of the run's; sandboxed code must never "
                "see one — drop it from the sandbox env"
            )
    return env
