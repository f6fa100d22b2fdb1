"""What authentication costs one weight-sync version, measured in the run that reports it.

Per version the trainer MACs every record it sends (HMAC-SHA256 over the frame's bytes; each
receiver checks them again) and signs the frame once (Ed25519 over the end record's MAC, the
last link of the chain); each receiver checks that one signature. So the MACs grow with the
frame, and the signature does not. ``crypto_costs`` times both on this host with the keys and
functions the transport uses (``auth.FrameKeys``, ``auth.sign``, ``auth.signed_by_trainer``),
for a frame of the measured size, so the e2e suite can set them beside a steady version.
"""

from __future__ import annotations

import hashlib
import hmac
import statistics
import time

from modal_rl.run_key import new_run_key
from modal_rl.weightsync.wire.auth import FrameKeys, sign, signed_by_trainer

_STEP = 8 << 20  # the MAC is timed over a buffer this size, repeated up to the frame's bytes


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def crypto_costs(frame_bytes: float, receivers: int, repeat: int = 200) -> dict[str, float]:
    """Seconds per version: ``mac_s`` (one side's HMAC-SHA256 over ``frame_bytes``),
    ``sign_s`` (the trainer's one signature), ``verify_s`` (one receiver's check), and
    ``signature_s`` = sign + verify, the latency a version gains (receivers verify at once),
    with ``signature_cpu_s`` = sign + ``receivers`` verifies, the CPU it costs in all."""
    keys = FrameKeys(new_run_key())
    reader = FrameKeys.reading(_reader_text(keys))
    digest = hashlib.sha256(b"end record").digest()
    sig = sign(keys, "frame", digest)
    assert signed_by_trainer(reader, "frame", digest, sig)
    sign_s = statistics.median(_best(lambda: sign(keys, "frame", digest), 5) for _ in range(repeat // 5))
    verify_s = statistics.median(
        _best(lambda: signed_by_trainer(reader, "frame", digest, sig), 5) for _ in range(repeat // 5)
    )
    block = bytes(min(_STEP, max(1, int(frame_bytes))))
    per_block = _best(lambda: hmac.new(keys.mac, block, hashlib.sha256).digest(), 3)
    mac_s = per_block * max(1.0, frame_bytes / len(block))
    return {
        "mac_s": mac_s,
        "sign_s": sign_s,
        "verify_s": verify_s,
        "signature_s": sign_s + verify_s,
        "signature_cpu_s": sign_s + receivers * verify_s,
    }


def _reader_text(keys: FrameKeys) -> str:
    """A frame-read key for ``keys``' public key (the secret part does not matter here)."""
    import base64

    raw = keys.public.public_bytes_raw()
    return "x." + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
