"""The run's secret: one random key per run, the only credential a run's endpoints accept.

The launcher makes it (``new_run_key``) and hands it on: to Modal containers as a Modal
Secret made for the run (``modal_secret``), to local processes through the environment
(``RUN_KEY_ENV``). Everything that exposes a port reads it with ``run_key()``.

Invariants:
- the key is never put on a command line, in a plan, a log line or an error message;
  ``redact`` replaces it wherever text leaves the process (dry-run plans, error tails);
- each use gets its own derived key (``derive``), so a key leaked from one place (say, an
  engine's bearer token in a proxy log) does not forge another (weight-frame MACs);
- capabilities, not a shared secret: the raw key stays with the launcher and the trainer
  (which signs frames, pulls, leases and ``latest`` with an Ed25519 key derived from it). Every other part gets only the derived key it needs (``engine_bearer``, ``ray_token``, ``frame_read_key``):
  engines ``ENGINE_BEARER_ENV`` and ``FRAME_READ_ENV`` (``engine_env``), Ray ``ray_token``;
  none of them gives back the run key or another part's key (``docs/security.md``);
- comparisons are constant-time (``hmac.compare_digest``).

Keyless modes are explicit: callers pass ``key=None`` themselves; nothing here falls back
to "no key" silently.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets

RUN_KEY_ENV = "MODAL_RL_RUN_KEY"
# Ray 2.60 token authentication reads the token from this variable (and RAY_AUTH_MODE=token).
RAY_TOKEN_ENV = "RAY_AUTH_TOKEN"
# What an engine process holds instead of the run key: its bearer token (the one header its
# guard accepts) and the frame-read key (frame-server handshake and record MACs, and the
# trainer's public key, which checks its signed frames, pulls and store records).
ENGINE_BEARER_ENV = "MODAL_RL_ENGINE_BEARER"
FRAME_READ_ENV = "MODAL_RL_FRAME_READ_KEY"
# Every variable that carries the key or a capability: stripped from child environments that
# must hold none (sandboxes, keyless engines) and never printed.
SECRET_ENVS = (RUN_KEY_ENV, RAY_TOKEN_ENV, ENGINE_BEARER_ENV, FRAME_READ_ENV)
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
    """A 32-byte key for one purpose (``"frames"``, ``"pull"``, ...), from the run key.

    The whole key counts: it is hashed to BLAKE2b's 64-byte key size first (cut there instead,
    two keys sharing their first 64 bytes would derive alike)."""
    raw = key.encode() if isinstance(key, str) else key
    whole = hashlib.blake2b(raw, digest_size=64, person=b"modal-rl-key").digest()
    return hashlib.blake2b(purpose.encode(), key=whole, digest_size=32, person=b"modal-rl").digest()


def _text(raw: bytes) -> str:
    """A derived key as URL-safe text (43 characters): what one part holds in place of the run
    key (an env var, a header, a Ray token). One-way: it gives back neither the run key nor
    any other purpose's key."""
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def engine_bearer(key: str) -> str:
    """The bearer token every engine of the run accepts (and nothing else does)."""
    return _text(derive(key, "engine-bearer"))


def ray_token(key: str) -> str:
    """The run's Ray token (``RAY_AUTH_TOKEN``): submits jobs, so no engine holds it."""
    return _text(derive(key, "ray-token"))


def frame_read_key(key: str) -> str:
    """The frame-read capability, ``<read secret>.<trainer public key>``: the secret passes the
    frame-server handshake and checks record MACs; the public key checks the trainer's
    signatures (frames, pulls, ``latest``, leases). It signs nothing (``auth.FrameKeys``)."""
    return _text(derive(key, "weightsync-reader")) + "." + _text(trainer_public_key(key))


def trainer_signing_seed(key: str) -> bytes:
    """The 32-byte Ed25519 seed of the trainer's signing key, derived from the run key: a
    relaunched trainer signs with the same key, so nothing new is handed out. Only the
    holders of the run key (launcher, trainer) can make it."""
    return derive(key, "weightsync-ed25519-seed")


def trainer_public_key(key: str) -> bytes:
    """The raw 32-byte Ed25519 public key that checks the trainer's signatures."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    private = Ed25519PrivateKey.from_private_bytes(trainer_signing_seed(key))
    return private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def engine_env(key: str, frames: bool = True) -> dict[str, str]:
    """What an engine process gets in place of the run key: its bearer, and the frame-read key
    when it pulls modal_rl weight frames (``frames``; an SGLang engine does not)."""
    env = {ENGINE_BEARER_ENV: engine_bearer(key)}
    if frames:
        env[FRAME_READ_ENV] = frame_read_key(key)
    return env


def engine_bearer_from_env(environ: dict[str, str] | None = None) -> str:
    """The engine bearer this process holds: ``ENGINE_BEARER_ENV``, else derived from the run
    key (a launcher or trainer); ``MissingRunKeyError`` with the fix when it has neither."""
    env = os.environ if environ is None else environ
    bearer = env.get(ENGINE_BEARER_ENV, "")
    if bearer:
        return bearer
    if env.get(RUN_KEY_ENV):
        return engine_bearer(env[RUN_KEY_ENV])
    raise MissingRunKeyError(
        f"no engine key: neither {ENGINE_BEARER_ENV} nor {RUN_KEY_ENV} is set. Start engines "
        "through modal_rl's engine pool, which gives each its bearer"
    )


def key_env(key: str) -> dict[str, str]:
    """The environment entries that carry ``key`` to a trainer-side process or container: our
    own variable, and Ray's token (derived: ``ray_token``; Ray reads it only where
    ``RAY_AUTH_MODE=token``). Engines get ``engine_env`` instead."""
    return {RUN_KEY_ENV: key, RAY_TOKEN_ENV: ray_token(key)}


def modal_secret(key: str):
    """A Modal Secret made for this run; attach it to every function the run defines."""
    from modal_rl.modal_calls import secret_from_dict

    return secret_from_dict(key_env(key))


def secret_texts(key: str) -> tuple[str, ...]:
    """The key and every capability text made from it (what ``redact`` replaces): the whole
    frame-read key first, then its secret part alone (the public part is no secret)."""
    reader = frame_read_key(key)
    return (key, engine_bearer(key), ray_token(key), reader, reader.partition(".")[0])


def engine_secret(key: str, frames: bool = True):
    """The Modal Secret an engine container gets: ``engine_env(key, frames)`` only."""
    from modal_rl.modal_calls import secret_from_dict

    return secret_from_dict(engine_env(key, frames))


def redact(text: str, key: str | None = None) -> str:
    """``text`` with the key (given, or the run's from the environment) and the capabilities
    made from it replaced."""
    key = key if key is not None else run_key_or_none()
    if not key:
        return text
    for secret in secret_texts(key):
        text = text.replace(secret, REDACTED)
    return text


def same(a: str | bytes, b: str | bytes) -> bool:
    """Constant-time equality of two keys or tags."""
    a = a.encode() if isinstance(a, str) else a
    b = b.encode() if isinstance(b, str) else b
    return hmac.compare_digest(a, b)
