"""Shared helpers for the weight-sync tests: states, bit-exact comparison, frame surgery."""

from __future__ import annotations

import contextlib
import json
import struct

import torch

from modal_rl.weightsync.wire.auth import trailer_size
from modal_rl.weightsync.wire.frames import RECORD_HEADER

TEST_KEY = "test-run-key-0123456789abcdef0123456789abcdef"  # what the tests export as the run key
OTHER_KEY = "another-run-key-fedcba9876543210fedcba9876543210"

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


def bits(t: torch.Tensor) -> bytes:
    return t.detach().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    if list(a) != list(b):
        return False
    return all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and bits(a[k]) == bits(b[k]) for k in a)


def clone_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def random_tensor(shape, dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(dtype)
    return torch.randn(shape, generator=gen).to(dtype)


def perturb(state: dict[str, torch.Tensor], density: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """A new version: ``density`` of each tensor's words get a different bit pattern."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        words = t.detach().reshape(-1).view(torch.uint8).clone()
        size = t.element_size()
        grid = words.view(-1, size) if t.numel() else words.view(0, size)
        chosen = torch.rand(grid.shape[0], generator=gen) < density
        flips = torch.randint(1, 256, (int(chosen.sum()),), generator=gen, dtype=torch.uint8)
        grid[chosen, 0] ^= flips
        out[name] = words.view(t.dtype).reshape(t.shape)
    return out


def model_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small transformer-shaped bf16 state with an odd mix of shapes."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "embed.weight": (1000, 64),
        "layer.0.q.weight": (64, 64),
        "layer.0.q.bias": (64,),
        "layer.0.norm.weight": (64,),
        "layer.0.mlp.weight": (257, 64),
        "scalar": (),
        "empty": (0, 5),
        "head.weight": (3, 7, 11),
    }
    return {k: random_tensor(s, torch.bfloat16, gen) for k, s in shapes.items()}


def records(frame: bytes) -> list[tuple[int, int, bytes]]:
    """(offset, length, tag) of every record in a frame (tags in upper case, signed or not)."""
    out, offset = [], 0
    while offset < len(frame):
        tag, length = RECORD_HEADER.unpack_from(frame, offset)
        size = RECORD_HEADER.size + length + trailer_size(tag)
        out.append((offset, size, tag.upper()))
        offset += size
    return out


def reseal(frame: bytes, offset: int, body: bytes) -> bytes:
    """Replace the body of the record at ``offset`` and recompute its checksum, so the
    corruption gets past the record check and must be caught by a deeper one (a signed
    record keeps its old MAC: what an attacker without the key can do)."""
    import xxhash

    tag, length = RECORD_HEADER.unpack_from(frame, offset)
    header = RECORD_HEADER.pack(tag, len(body))
    trailer = struct.pack("<Q", xxhash.xxh3_64_intdigest(header + body))
    mac_start = offset + RECORD_HEADER.size + length + 8
    end = offset + RECORD_HEADER.size + length + trailer_size(tag)
    return frame[:offset] + header + body + trailer + frame[mac_start:end] + frame[end:]


def client_handshake(sock, key: str | None, have: int | None = None) -> None:
    """Pass a frame server's handshake on a raw socket (as ``TcpSource`` does), for tests
    that need a receiver which then misbehaves (stalls, ...)."""
    from modal_rl.weightsync.wire.auth import check_server_hello, client_proof, frame_keys, hello_line

    keys = frame_keys(key)
    line, nonce = hello_line(have, keys)
    sock.sendall(line)
    if keys is None:
        return
    answer = b""
    while not answer.endswith(b"\n"):
        answer += sock.recv(1)
    server_nonce = check_server_hello(answer, keys, nonce, "test")
    sock.sendall(json.dumps({"proof": client_proof(keys, nonce, server_nonce, line)}).encode() + b"\n")


def self_signed_cert(directory) -> tuple[str, str]:
    """(certfile, keyfile) of a fresh self-signed certificate for 127.0.0.1 and localhost."""
    import datetime
    import ipaddress
    from pathlib import Path

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    san = x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(san, critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    certfile, keyfile = Path(directory) / "cert.pem", Path(directory) / "key.pem"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return str(certfile), str(keyfile)


class TlsTerminator:
    """A local stand-in for a Modal tunnel's TLS end: accepts TLS on 127.0.0.1 and forwards
    the plain bytes to ``target`` (as Modal's edge forwards to a container's port)."""

    def __init__(self, target: tuple[str, int], certfile: str, keyfile: str) -> None:
        import socket
        import ssl
        import threading

        self.target = target
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(certfile, keyfile)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import ssl
        import threading

        while not self.closed:
            try:
                raw, _ = self.listener.accept()
                tls = self.context.wrap_socket(raw, server_side=True)
            except (OSError, ssl.SSLError):
                continue
            upstream = socket.create_connection(self.target)
            for a, b in ((tls, upstream), (upstream, tls)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src, dst) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()

    def close(self) -> None:
        self.closed = True
        self.listener.close()
