"""The run's secret: one random key per run, the only credential a run's endpoints accept.

The launcher makes it (``new_run_key``) and hands it on: to Modal containers as a Modal
Secret made for the run (``modal_secret``), to local processes through the environment
(``RUN_KEY_ENV``). Everything that exposes a port reads it with ``run_key()``.

Invariants:
- the key is never put on a command line, in a plan, a log line or an error message;
  ``redact`` replaces it wherever text leaves the process (dry-run plans, error tails);
- each use gets its own derived key (``derive``), so a key leaked from one place (say, an
  engine's bearer token in a proxy log) does not forge another (weight-frame MACs);
- comparisons are constant-time (``hmac.compare_digest``).

Keyless modes are explicit: callers pass ``key=None`` themselves; nothing here falls back
to "no key" silently.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

RUN_KEY_ENV = "MODAL_RL_RUN_KEY"
# Ray 2.60 token authentication reads the token from this variable (and RAY_AUTH_MODE=token).
RAY_TOKEN_ENV = "RAY_AUTH_TOKEN"
REDACTED = "<redacted>"
KEY_BYTES = 32


class MissingRunKeyError(RuntimeError):
    """A component that must authenticate found no run key in its environment."""


def new_run_key() -> str:
    """A fresh 256-bit key as URL-safe text (fits env vars, HTTP headers and Ray tokens)."""
    return secrets.token_urlsafe(KEY_BYTES)


def ensure_run_key(environ: dict[str, str] | None = None) -> str:
    """The run's key, made now when the environment has none (a user-exported key is kept).

    Launchers call this first, so they and every process they start share one key.
    """
    env = os.environ if environ is None else environ
    if not env.get(RUN_KEY_ENV):
        env[RUN_KEY_ENV] = new_run_key()
    return env[RUN_KEY_ENV]


def run_key(environ: dict[str, str] | None = None) -> str:
    """The run's key from the environment; raises with the fix when it is missing."""
    env = os.environ if environ is None else environ
    key = env.get(RUN_KEY_ENV, "")
    if not key:
        raise MissingRunKeyError(
            f"no run key: {RUN_KEY_ENV} is not set. Start the run through a launcher "
            "(python -m verl_modal / slime_modal / modal_rl.cluster), which makes one, or "
            f"export {RUN_KEY_ENV} to the run's key"
        )
    return key


def run_key_or_none(environ: dict[str, str] | None = None) -> str | None:
    env = os.environ if environ is None else environ
    return env.get(RUN_KEY_ENV) or None


def derive(key: str | bytes, purpose: str) -> bytes:
    """A 32-byte key for one purpose (``"frames"``, ``"pull"``, ...), from the run key."""
    raw = key.encode() if isinstance(key, str) else key
    return hashlib.blake2b(purpose.encode(), key=raw[:64], digest_size=32, person=b"modal-rl").digest()


def key_env(key: str) -> dict[str, str]:
    """The environment entries that carry ``key`` to a process or container: our own
    variable, and Ray's token variable (Ray uses it only where ``RAY_AUTH_MODE=token``)."""
    return {RUN_KEY_ENV: key, RAY_TOKEN_ENV: key}


def modal_secret(key: str):
    """A Modal Secret made for this run; attach it to every function the run defines."""
    import modal

    return modal.Secret.from_dict(key_env(key))


def redact(text: str, key: str | None = None) -> str:
    """``text`` with the key (given, or the run's from the environment) replaced."""
    key = key if key is not None else run_key_or_none()
    return text.replace(key, REDACTED) if key else text


def same(a: str | bytes, b: str | bytes) -> bool:
    """Constant-time equality of two keys or tags."""
    a = a.encode() if isinstance(a, str) else a
    b = b.encode() if isinstance(b, str) else b
    return hmac.compare_digest(a, b)
