"""Redaction of the run key and every key derived from it, in text, bytes and streams.

Used wherever something an engine or a server prints leaves our process: the key forwarder's
answers, and the engine log relays (``engine_local``, ``engines_modal``). Invariant: after
``Redactor(key)``, no output of ``bytes``, ``text`` or ``feed``/``flush`` contains any of
``secret_forms(key)``, even when a stream splits one across chunks.
"""

from __future__ import annotations

import base64

from modal_rl.run_key import REDACTED, derive

# Every purpose the project passes to ``run_key.derive`` for a secret (``weightsync-run-id`` is a
# public fingerprint, not a key). An engine or a log that shows one of these keys gives away what
# it protects, so they are redacted like the key; a test checks this list against the code.
DERIVED_PURPOSES = (
    "weightsync-frame-mac",
    "weightsync-handshake",
    "weightsync-pull",
    "weightsync-lease",
    "weightsync-latest",
    "control",
)


def secret_forms(key: str | None) -> tuple[bytes, ...]:
    """The byte strings that give ``key`` away, longest first: the key itself, and each key
    derived from it (``DERIVED_PURPOSES``) in the text forms code prints a 32-byte key in
    (hex, base64 and url-safe base64 without padding: a padded one contains these)."""
    if not key:
        return ()
    forms = {key.encode()}
    for purpose in DERIVED_PURPOSES:
        raw = derive(key, purpose)
        forms |= {raw.hex().encode(), raw.hex().upper().encode()}
        forms |= {base64.b64encode(raw).rstrip(b"="), base64.urlsafe_b64encode(raw).rstrip(b"=")}
    return tuple(sorted(forms, key=len, reverse=True))


class Redactor:
    """Replaces every ``secret_forms(key)`` by ``<redacted>``: in text, in bytes, and in a stream.

    ``feed(chunk)`` returns what may go out now; a tail of the stream that could begin a secret
    waits for the next chunk (or ``flush()`` at the end), so a key split across chunks is caught
    too. Only text forms are secrets, so a chunk that ends in a newline (a log line, a
    server-sent event) is never held. One instance per stream (it keeps that stream's tail).
    """

    def __init__(self, key: str | None):
        self.forms = secret_forms(key)
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
