"""Authenticated weight frames: the keys, record MACs, and the frame-server handshake.

Everything here is keyed by the run's secret (``modal_rl.run_key``) through keys derived
per purpose (``derive``), so the frame MAC key, the handshake key and the pull-request key
are three different keys, none of them is the run key, and none is the engines' bearer
token or the Ray token (``run_key.engine_bearer``, ``ray_token``).

Record MACs (format: ``docs/weight-sync-format.md``, "Signed frames"). A signed record is

    tag (lower case) | body_len u32 | body | xxh3_64(tag, body_len, body) | mac (32 bytes)

with ``mac_i = HMAC-SHA256(K_mac, "MRLW-mac1" | u32 i | mac_{i-1} | tag | body_len | body)``,
``i`` the record's index in its frame and ``mac_{-1}`` 32 zero bytes. Chaining each MAC to
the previous one binds a record to its exact frame (and, through record 0, the version
header, to the frame's kind, version and base); the key binds it to the run. So a record
cannot be moved, dropped, duplicated or spliced in from another frame or run.

Invariants:
- keyless mode is only ever chosen by a caller (``key=None``); an omitted key means the
  run's key from the environment (``FROM_ENV``), which raises when it is not set;
- a ``Verifier`` returns a record's body only after its checksum and its MAC matched;
  all comparisons of MACs and proofs are constant-time;
- derived keys never appear in ``repr``, logs or error messages.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import struct

import xxhash

from modal_rl import wire_json
from modal_rl.run_key import FRAME_READ_ENV, RUN_KEY_ENV, derive, frame_read_key, run_key
from modal_rl.text_safety import clean
from modal_rl.weightsync.errors import (
    CorruptFrameError,
    HandshakeError,
    RecordMacError,
    SignedFrameError,
    UnsignedFrameError,
)

MAC_SIZE = 32
MAX_HANDSHAKE_LINE = 4096  # = transport_tcp.MAX_LINE (the server's bound on each line)
MAC_DOMAIN = b"MRLW-mac1"
HANDSHAKE = "hmac-sha256-v1"
_ZERO_MAC = bytes(MAC_SIZE)
_INDEX = struct.Struct("<I")
_HEADER = struct.Struct("<cI")  # = frames.RECORD_HEADER (not imported: frames imports us)
_XXH = struct.Struct("<Q")
UNSIGNED_TAGS = frozenset(b"VGCSE")
SIGNED_TAGS = frozenset(b"vgcse")


class _FromEnv:
    def __repr__(self) -> str:
        return "FROM_ENV"


FROM_ENV = _FromEnv()  # the default of every ``key`` parameter: the run's key from the environment


class FrameKeys:
    """Keys derived for weight sync; the run key itself is not kept.

    Two capabilities (``run_key.frame_read_key``): a *reader* (an engine, a receiver) holds
    only the frame-read key, from which the handshake, frame-MAC, pull and ``latest`` keys
    are derived; it can pass the frame server's handshake, check frames, pulls and ``latest``
    records, and nothing else. A *writer* (the trainer, from the run key) also holds the lease
    key: only it can sign a store's lease. Neither is an engine bearer or the Ray token.
    (HMACs are symmetric: a reader's key also makes frames that other readers accept; it
    never makes a lease, a bearer or a Ray token. See docs/security.md.)"""

    __slots__ = ("mac", "handshake", "pull", "lease", "pointer", "run_id")

    def __init__(self, key: str | None, *, reader: str | None = None) -> None:
        if key is not None:
            reader = frame_read_key(key)
            self.lease: bytes | None = derive(key, "weightsync-lease")
        elif reader:
            self.lease = None  # a reader signs no lease
        else:
            raise ValueError("FrameKeys needs the run key or the frame-read key")
        self.mac = derive(reader, "weightsync-frame-mac")
        self.handshake = derive(reader, "weightsync-handshake")
        self.pull = derive(reader, "weightsync-pull")
        self.pointer = derive(reader, "weightsync-latest")  # a store's ``latest`` record
        # The run's public name in frames and leases: a fingerprint of the key (one-way, so
        # it reveals nothing of it); a restarted trainer of the same run has the same id.
        self.run_id = "run-" + derive(reader, "weightsync-run-id")[:8].hex()

    @classmethod
    def reading(cls, reader: str) -> FrameKeys:
        """Reader keys from the frame-read key alone (what an engine holds)."""
        return cls(None, reader=reader)

    @property
    def writer(self) -> bool:
        return self.lease is not None

    def __repr__(self) -> str:
        return "FrameKeys(<redacted>)"


def frame_keys(key) -> FrameKeys | None:
    """Resolve a ``key`` argument: ``FROM_ENV`` (the default) → the run's key from the
    environment, else the frame-read key (``MODAL_RL_FRAME_READ_KEY``: reader keys); ``None``
    → keyless; the run key text; or ``FrameKeys`` already derived."""
    if key is FROM_ENV:
        import os

        reader = os.environ.get(FRAME_READ_ENV)
        if reader and not os.environ.get(RUN_KEY_ENV):
            return FrameKeys.reading(reader)
        key = run_key()
    if key is None or isinstance(key, FrameKeys):
        return key
    if not isinstance(key, str) or not key:
        raise ValueError("key must be the run key (text), or None for an explicitly keyless setup")
    return FrameKeys(key)


def run_id_of(keys: FrameKeys | None) -> str:
    """The run id frames carry: the key's fingerprint, or ``MODAL_RL_RUN_ID`` (else
    ``"keyless"``) for an explicitly keyless setup."""
    if keys is not None:
        return keys.run_id
    import os

    return os.environ.get("MODAL_RL_RUN_ID") or "keyless"


JSON_PURPOSES = ("lease", "pointer")  # the store records signed with ``sign_json``


def sign_json(keys: FrameKeys | None, obj: dict, purpose: str = "lease") -> dict:
    """``obj`` plus ``mac`` (HMAC-SHA256 over its canonical JSON under the key derived for
    ``purpose``: ``"lease"`` or ``"pointer"``, so one record cannot pass for the other);
    keyless: ``obj`` unchanged."""
    if purpose not in JSON_PURPOSES:
        raise ValueError(f"unknown signed-record purpose {purpose!r}")
    if keys is None:
        return dict(obj)
    if getattr(keys, purpose) is None:
        raise PermissionError(
            f"this process holds the frame-read key only: it cannot sign a {purpose} record"
        )
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return {**obj, "mac": hmac.new(getattr(keys, purpose), canonical, hashlib.sha256).hexdigest()}


def verify_json(keys: FrameKeys | None, obj: dict, purpose: str = "lease") -> bool:
    """Whether ``obj`` (from ``sign_json`` with ``purpose``) carries a matching MAC (keyless:
    it carries none)."""
    if keys is None:
        return "mac" not in obj
    if getattr(keys, purpose) is None:
        return False  # a reader cannot check a lease (nor does it need to)
    body = {k: v for k, v in obj.items() if k != "mac"}
    return same_proof(sign_json(keys, body, purpose)["mac"], obj.get("mac"))


def is_signed_tag(tag: bytes) -> bool:
    return tag[0] in SIGNED_TAGS


def trailer_size(tag: bytes) -> int:
    """Bytes after a record's body: the xxh3 digest, and the MAC for a signed record."""
    return _XXH.size + (MAC_SIZE if tag[0] in SIGNED_TAGS else 0)


def _mac(keys: FrameKeys, index: int, prev: bytes, header: bytes, body) -> bytes:
    h = hmac.new(keys.mac, digestmod=hashlib.sha256)
    h.update(MAC_DOMAIN + _INDEX.pack(index) + prev + header)
    h.update(body)  # hashlib drops the GIL for large buffers
    return h.digest()


class Signer:
    """Turns one frame's unsigned records (as the codec writes them) into signed records.

    One ``Signer`` per frame: records must be given in frame order, starting with the
    version header."""

    def __init__(self, keys: FrameKeys) -> None:
        self.keys = keys
        self.index = 0
        self.prev = _ZERO_MAC

    def sign(self, raw: bytes) -> bytes:
        tag = raw[:1]
        if not tag or tag[0] not in UNSIGNED_TAGS:
            raise ValueError(f"not an unsigned weight-sync record (tag {tag!r})")
        view = memoryview(raw)
        body = view[_HEADER.size : len(raw) - _XXH.size]
        header = _HEADER.pack(tag.lower(), len(body))
        digest = xxhash.xxh3_64(header)
        digest.update(body)
        mac = _mac(self.keys, self.index, self.prev, header, body)
        self.index += 1
        self.prev = mac
        return b"".join((header, body, _XXH.pack(digest.intdigest()), mac))


def sign_records(records, keys: FrameKeys | None):
    """Sign one frame's records in order (``keys=None``: pass them through, keyless)."""
    if keys is None:
        yield from records
        return
    signer = Signer(keys)
    for rec in records:
        yield signer.sign(rec)


class Verifier:
    """Checks one frame's records in order: checksum first (accidents), then the MAC
    (forgery, splicing, another run's key). Keyless verifiers accept only unsigned records;
    keyed ones only signed records."""

    def __init__(self, keys: FrameKeys | None) -> None:
        self.keys = keys
        self.index = 0
        self.prev = _ZERO_MAC

    def check(self, raw: bytes | bytearray | memoryview) -> memoryview:
        """The body of ``raw`` (a whole record), once it is verified."""
        tag = bytes(raw[:1])  # a store reader passes a view into its read buffer
        signed = tag[0] in SIGNED_TAGS
        name = tag.decode().upper()
        if signed and self.keys is None:
            raise SignedFrameError(
                f"the {name} record is signed with a run key, but this receiver is keyless (key=None); "
                "give the receiver the run's key (MODAL_RL_RUN_KEY)"
            )
        if not signed and self.keys is not None:
            raise UnsignedFrameError(
                f"the {name} record is not signed; this receiver accepts only frames signed with the "
                "run's key (is the publisher keyless? give it the run's key)"
            )
        view = memoryview(raw)
        end = len(raw) - trailer_size(tag)
        header, body = view[: _HEADER.size], view[_HEADER.size : end]
        (digest,) = _XXH.unpack_from(raw, end)
        h = xxhash.xxh3_64(header)
        h.update(body)
        if h.intdigest() != digest:
            raise CorruptFrameError(f"checksum mismatch in a {name} record")
        if signed:
            mac = _mac(self.keys, self.index, self.prev, bytes(header), body)
            if not hmac.compare_digest(mac, view[end + _XXH.size :]):
                raise RecordMacError(
                    f"record {self.index} ({name}) fails its MAC: altered, out of place, or signed "
                    "with another run's key"
                )
            self.prev = mac
        self.index += 1
        return body


# -- frame-server handshake -----------------------------------------------------------
# C→S  {"have": N, "auth": HANDSHAKE, "nonce": cn}            (keyless: {"have": N})
# S→C  {"auth": HANDSHAKE, "nonce": sn, "proof": P_s}         P_s = HMAC(K_hs, "server" | cn | sn)
# C→S  {"proof": P_c}                                         P_c = HMAC(K_hs, "client" | cn | sn | hello)
# The server sends no frame byte before P_c matched; the client reads none before P_s did.
# Refusals are one line {"error": "..."} and a closed connection.


def new_nonce() -> str:
    return secrets.token_hex(32)


def _proof(keys: FrameKeys, role: bytes, *parts: bytes) -> str:
    h = hmac.new(keys.handshake, role + b"\0", hashlib.sha256)
    for part in parts:
        h.update(_INDEX.pack(len(part)) + part)
    return h.hexdigest()


def server_proof(keys: FrameKeys, client_nonce: str, server_nonce: str) -> str:
    return _proof(keys, b"server", client_nonce.encode(), server_nonce.encode())


def client_proof(keys: FrameKeys, client_nonce: str, server_nonce: str, hello: bytes) -> str:
    return _proof(keys, b"client", client_nonce.encode(), server_nonce.encode(), hello)


def same_proof(expected: str, got) -> bool:
    return isinstance(got, str) and hmac.compare_digest(expected.encode(), got.encode())


def hello_line(
    have: int | None, keys: FrameKeys | None, epoch: int | None = None, decode: dict | None = None
) -> tuple[bytes, str | None]:
    """The receiver's first line, and its nonce (None when keyless). ``epoch``: the epoch of
    the version held; ``decode``: the receiver's measured decode costs (``decode_costs``).
    The client proof covers the whole line, so both are authenticated."""
    hello: dict = {"have": have}
    if epoch is not None:
        hello["epoch"] = epoch
    if decode is not None:
        hello["decode"] = decode
    if keys is None:
        return json.dumps(hello).encode() + b"\n", None
    nonce = new_nonce()
    return json.dumps({**hello, "auth": HANDSHAKE, "nonce": nonce}).encode() + b"\n", nonce


def _line_json(line: bytes):
    """A server's line as JSON, bounded (``wire_json``), or None for anything else."""
    try:
        return wire_json.loads(line, max_bytes=MAX_HANDSHAKE_LINE, max_depth=4)
    except wire_json.WireError:
        return None


def refusal(line: bytes, where: str) -> str:
    """The message for a server's ``{"error": ...}`` line (or for a line that is none)."""
    answer = _line_json(line)
    if isinstance(answer, dict) and "error" in answer:
        return f"frame server at {where} refused this receiver: {clean(str(answer['error'])[:200])}"
    return f"frame server at {where} sent an unexpected line instead of a frame"


def check_server_hello(line: bytes, keys: FrameKeys, client_nonce: str, where: str) -> str:
    """The server's answer to a keyed hello; returns the server's nonce, or raises."""
    answer = _line_json(line)
    if not isinstance(answer, dict):
        raise HandshakeError(f"frame server at {where} did not answer the key handshake")
    if "error" in answer:
        raise HandshakeError(refusal(line, where))
    nonce = answer.get("nonce")
    if answer.get("auth") != HANDSHAKE or not isinstance(nonce, str) or len(nonce) != 64:
        raise HandshakeError(f"frame server at {where} does not speak the {HANDSHAKE} handshake")
    if not same_proof(server_proof(keys, client_nonce, nonce), answer.get("proof")):
        raise HandshakeError(
            f"frame server at {where} does not know this run's key (it may belong to another run); "
            "refusing its frames"
        )
    return nonce
