"""Authenticated weight frames: the keys, record MACs, the trainer's signatures, and the
frame-server handshake.

Everything here is keyed by the run's secret (``modal_rl.run_key``) through keys derived
per purpose (``derive``): the record-MAC and handshake keys (from the frame-read key every
receiver holds) and the trainer's Ed25519 signing key (from the run key, which only the
launcher and the trainer hold). None of them is the run key, the engines' bearer token or
the Ray token (``run_key.engine_bearer``, ``ray_token``).

Record MACs (format: ``docs/weight-sync-format.md``, "Signed frames"). A signed record is

    tag (lower case) | body_len u32 | body | xxh3_64(tag, body_len, body) | mac (32 bytes)

with ``mac_i = HMAC-SHA256(K_mac, "MRLW-mac1" | u32 i | mac_{i-1} | tag | body_len | body)``,
``i`` the record's index in its frame and ``mac_{-1}`` 32 zero bytes. Chaining each MAC to
the previous one binds a record to its exact frame (and, through record 0, the version
header, to the frame's kind, version and base); the key binds it to the run. So a record
cannot be moved, dropped, duplicated or spliced in from another frame or run.

Signatures. Every receiver holds the MAC key, so a MAC only keeps out those without it.
What one receiver must not be able to make for another is signed by the trainer, Ed25519:
a signed frame's end record carries, after its MAC, a 64-byte signature over that MAC (the
last link of a chain over every record, so one signature per version and verification stays
one pass); pulls, ``latest`` and leases carry one over their canonical JSON. Each signature
is over ``"MRLW-sig1" 0 purpose 0 data``, so one purpose's never passes for another's.

Invariants:
- keyless mode is only ever chosen by a caller (``key=None``); an omitted key means the
  run's key from the environment (``FROM_ENV``), which raises when it is not set;
- a ``Verifier`` returns a record's body only after its checksum and its MAC matched, and
  the end record's only after the trainer's signature did (so a frame is used only once the
  trainer's signature covers all of it: the decoders stage until the end record);
- only a holder of the run key signs (``sign``, ``Signer``: ``PermissionError`` for a reader);
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
from modal_rl.run_key import (
    FRAME_READ_ENV,
    RUN_KEY_ENV,
    derive,
    frame_read_key,
    run_key,
    trainer_signing_seed,
)
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
_SIGNED_END = ord("e")


class _FromEnv:
    def __repr__(self) -> str:
        return "FROM_ENV"


FROM_ENV = _FromEnv()  # the default of every ``key`` parameter: the run's key from the environment


class FrameKeys:
    """Keys derived for weight sync; the run key itself is not kept.

    Two capabilities (``run_key.frame_read_key``): a *reader* (an engine, a receiver) holds
    the frame-read key: a secret, from which the handshake and record-MAC keys are derived,
    and the trainer's Ed25519 public key. It passes the frame server's handshake and checks
    frames, pulls, ``latest`` and leases. A *writer* (the trainer, from the run key) also holds
    the Ed25519 private key (``run_key.trainer_signing_seed``): only it signs a frame, a pull,
    a ``latest`` record or a lease. Record MACs are symmetric (a reader can make them); they
    keep bytes of anyone without the read key out before a record is used, and the trainer's
    one signature per frame (``Signer``) is what a reader cannot make. See docs/security.md."""

    __slots__ = ("mac", "handshake", "signer", "public", "run_id")

    def __init__(self, key: str | None, *, reader: str | None = None) -> None:
        if key is not None:
            reader = frame_read_key(key)
            self.signer = _private_key(trainer_signing_seed(key))
        elif reader:
            self.signer = None  # a reader signs nothing
        else:
            raise ValueError("FrameKeys needs the run key or the frame-read key")
        secret, _, public = reader.partition(".")
        if not secret:
            raise ValueError(f"the frame-read key ({FRAME_READ_ENV}) has no secret part before its '.'")
        self.public = _public_key(public)
        self.mac = derive(secret, "weightsync-frame-mac")
        self.handshake = derive(secret, "weightsync-handshake")
        # The run's public name in frames and leases: a fingerprint of the key (one-way, so
        # it reveals nothing of it); a restarted trainer of the same run has the same id.
        self.run_id = "run-" + derive(secret, "weightsync-run-id")[:8].hex()

    @classmethod
    def reading(cls, reader: str) -> FrameKeys:
        """Reader keys from the frame-read key alone (what an engine holds)."""
        return cls(None, reader=reader)

    @property
    def writer(self) -> bool:
        return self.signer is not None

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


SIG_SIZE = 64
SIG_DOMAIN = b"MRLW-sig1"
SIGNED_PURPOSES = ("lease", "pointer", "pull", "frame")  # what the trainer's key signs
JSON_PURPOSES = ("lease", "pointer")  # the store records signed with ``sign_json``


def _private_key(seed: bytes):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.from_private_bytes(seed)


def _public_key(text: str):
    """The trainer's public key from its text in the frame-read key; one line naming the fix
    for a frame-read key without one (made by a modal-rl before signatures)."""
    import base64

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ValueError(
            f"the frame-read key ({FRAME_READ_ENV}) carries no trainer public key: relaunch the "
            "engines with this modal-rl's launcher, which hands out <read key>.<public key>"
        )
    return Ed25519PublicKey.from_public_bytes(raw)


def _message(purpose: str, data: bytes) -> bytes:
    if purpose not in SIGNED_PURPOSES:
        raise ValueError(f"unknown signed-record purpose {purpose!r}")
    return SIG_DOMAIN + b"\0" + purpose.encode() + b"\0" + data  # one purpose's never passes for another's


def sign(keys: FrameKeys, purpose: str, data: bytes) -> bytes:
    """The trainer's Ed25519 signature of ``data`` for ``purpose``; ``PermissionError`` for a
    reader (it holds no private key)."""
    if keys.signer is None:
        raise PermissionError(
            f"this process holds the frame-read key only: it cannot sign a {purpose} record "
            "(only the trainer, which holds the run key, signs)"
        )
    return keys.signer.sign(_message(purpose, data))


def signed_by_trainer(keys: FrameKeys, purpose: str, data: bytes, signature) -> bool:
    """Whether ``signature`` is the trainer's over ``data`` for ``purpose``."""
    from cryptography.exceptions import InvalidSignature

    if not isinstance(signature, bytes | bytearray | memoryview) or len(signature) != SIG_SIZE:
        return False
    try:
        keys.public.verify(bytes(signature), _message(purpose, data))
    except InvalidSignature:
        return False
    return True


def _canonical(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def sign_json(keys: FrameKeys | None, obj: dict, purpose: str = "lease") -> dict:
    """``obj`` plus ``sig`` (the trainer's Ed25519 signature, hex, over its canonical JSON for
    ``purpose``: ``"lease"`` or ``"pointer"``, so one record cannot pass for the other);
    keyless: ``obj`` unchanged."""
    if purpose not in JSON_PURPOSES:
        raise ValueError(f"unknown signed-record purpose {purpose!r}")
    if keys is None:
        return dict(obj)
    return {**obj, "sig": sign(keys, purpose, _canonical(obj)).hex()}


def verify_json(keys: FrameKeys | None, obj: dict, purpose: str = "lease") -> bool:
    """Whether ``obj`` (from ``sign_json`` with ``purpose``) carries the trainer's signature
    (keyless: it carries none, nor an older record's ``mac``)."""
    if purpose not in JSON_PURPOSES:
        raise ValueError(f"unknown signed-record purpose {purpose!r}")
    if keys is None:
        return "sig" not in obj and "mac" not in obj
    sig = obj.get("sig")
    if not isinstance(sig, str) or len(sig) != 2 * SIG_SIZE:
        return False
    try:
        raw = bytes.fromhex(sig)
    except ValueError:
        return False
    body = {k: v for k, v in obj.items() if k != "sig"}
    return signed_by_trainer(keys, purpose, _canonical(body), raw)


def is_signed_tag(tag: bytes) -> bool:
    return tag[0] in SIGNED_TAGS


def trailer_size(tag: bytes) -> int:
    """Bytes after a record's body: the xxh3 digest; the MAC for a signed record; and the
    trainer's signature after a signed frame's end record's MAC."""
    if tag[0] not in SIGNED_TAGS:
        return _XXH.size
    return _XXH.size + MAC_SIZE + (SIG_SIZE if tag[0] == _SIGNED_END else 0)


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
        if keys.signer is None:
            raise PermissionError(
                "this process holds the frame-read key only: it cannot sign frames (only the "
                "trainer, which holds the run key, publishes)"
            )
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
        # The end record's MAC ends a chain over every record of the frame: the trainer's one
        # signature over it covers them all (a chained HMAC under a key the readers hold is
        # still a collision-resistant digest, so nothing else has the same last MAC).
        sig = sign(self.keys, "frame", mac) if tag == b"E" else b""
        return b"".join((header, body, _XXH.pack(digest.intdigest()), mac, sig))


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
            at = end + _XXH.size
            if not hmac.compare_digest(mac, view[at : at + MAC_SIZE]):
                raise RecordMacError(
                    f"record {self.index} ({name}) fails its MAC: altered, out of place, or signed "
                    "with another run's key"
                )
            if tag[0] == _SIGNED_END and not signed_by_trainer(
                self.keys, "frame", mac, view[at + MAC_SIZE :]
            ):
                raise RecordMacError(
                    f"the frame's end record (record {self.index}) does not carry the trainer's "
                    "signature: made by a holder of the read key, not by the run's trainer; refused"
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
