"""Redaction of the run key and every key derived from it, in text, bytes and streams.

Used wherever something an engine or a server prints leaves our process: the key forwarder's
answers, and the engine log relays (``pool_local``, ``pool_modal``). Invariant: after
``Redactor(key)``, no output of ``bytes``, ``text`` or ``feed``/``flush`` contains any of
``secret_forms(key)``, even when a stream splits one across chunks.
"""

from __future__ import annotations

import base64
import os

from modal_rl.run_key import ENGINE_BEARER_ENV, FRAME_READ_ENV, REDACTED, derive, frame_read_key

# Every purpose the project passes to ``run_key.derive`` for a secret (``weightsync-run-id`` is a
# public fingerprint, not a key). An engine or a log that shows one of these keys gives away what
# it protects, so they are redacted like the key; a test checks this list against the code.
DERIVED_PURPOSES = (
    "weightsync-frame-mac",
    "weightsync-handshake",
    "weightsync-reader",
    "weightsync-ed25519-seed",
    "engine-bearer",
    "ray-token",
    "control",
)
# The purposes derived from the frame-read key's secret part (``auth.FrameKeys``), not from
# the run key. (Its other part, the trainer's public key, is no secret.)
READER_PURPOSES = ("weightsync-frame-mac", "weightsync-handshake")


def _printed(raw: bytes) -> set[bytes]:
    """The text forms code prints a 32-byte key in (hex, base64 and url-safe base64 without
    padding: a padded one contains these)."""
    return {
        raw.hex().encode(),
        raw.hex().upper().encode(),
        base64.b64encode(raw).rstrip(b"="),
        base64.urlsafe_b64encode(raw).rstrip(b"="),
    }


def secret_forms(key: str | None, held: tuple[str, ...] = ()) -> tuple[bytes, ...]:
    """The byte strings that give ``key`` away, longest first: the key itself, and each key
    derived from it (``DERIVED_PURPOSES``, the reader's through the frame-read key) in every
    printed form. ``held``: capabilities a process holds without the run key (an engine's
    bearer and frame-read key, read from its environment): they and what derives from them."""
    forms: set[bytes] = set()
    readers = [text for text in held if text]
    if key:
        forms.add(key.encode())
        for purpose in DERIVED_PURPOSES:
            forms |= _printed(derive(key, purpose))
        readers.append(frame_read_key(key))
    for text in readers:
        secret = text.partition(".")[0]  # a frame-read key is <secret>.<public key>
        forms |= {text.encode(), secret.encode()}
        forms |= _printed(_raw_of(secret))
        for purpose in READER_PURPOSES:
            forms |= _printed(derive(secret, purpose))
    return tuple(sorted(forms, key=len, reverse=True))


def _raw_of(text: str) -> bytes:
    """The bytes under a capability text (``run_key._text``); the text itself when it is none."""
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except ValueError:
        return text.encode()


def held_secrets(environ=None) -> tuple[str, ...]:
    """The capabilities in this process's environment (an engine's, a forwarder's)."""
    env = os.environ if environ is None else environ
    return tuple(env[name] for name in (ENGINE_BEARER_ENV, FRAME_READ_ENV) if env.get(name))


class Redactor:
    """Replaces every ``secret_forms(key)`` by ``<redacted>``: in text, in bytes, and in a stream.

    ``feed(chunk)`` returns what may go out now; a tail of the stream that could begin a secret
    waits for the next chunk (or ``flush()`` at the end), so a key split across chunks is caught
    too. Only text forms are secrets, so a chunk that ends in a newline (a log line, a
    server-sent event) is never held. One instance per stream (it keeps that stream's tail).
    """

    def __init__(self, key: str | None, held: tuple[str, ...] = ()):
        self.forms = secret_forms(key, held)
        self._text_forms = tuple(f.decode() for f in self.forms)
        self._held = b""

    def bytes(self, data: bytes) -> bytes:
        for form in self.forms:
            data = data.replace(form, REDACTED.encode())
        return data

    def text(self, line: str) -> str:
        for form in self._text_forms:
            line = line.replace(form, REDACTED)
        return line

    def feed(self, chunk: bytes) -> bytes:
        data = self.bytes(self._held + chunk)
        keep = self._partial(data)
        self._held = data[len(data) - keep :]
        return data[: len(data) - keep]

    def flush(self) -> bytes:
        held, self._held = self._held, b""
        return held  # shorter than any secret: nothing left to replace

    def _partial(self, data: bytes) -> int:
        """Length of the longest tail of ``data`` that is a proper prefix of a secret."""
        best = 0
        for form in self.forms:
            for n in range(min(len(form) - 1, len(data)), best, -1):
                if data.endswith(form[:n]):
                    best = n
                    break
        return best
