"""Suite ``weight-sync-tensors``: what a version costs per tensor, on a MoE-shaped state.

A MoE model's state is tens of thousands of small expert matrices beside a few large
tensors (a 235 B MoE has ~36k expert tensors), and dim-0 sharding hands every rank a piece
of every tensor. Where a version's work is Python per tensor, that cost does not shrink
with ranks or with the change rate. This suite measures it in one process, side by side on
the same versions:

- publisher: ``Publisher.publish`` of a delta with its delta layout (``codec.buckets``:
  groups, chunk tables and sums made once per anchor) and with the per-tensor encoder
  (``encode.encode_delta``), whose frames must be byte-identical (checked every version);
- receiver: ``apply_frame`` of that frame with a ``HeldLayout`` (``codec.held_layout``) and
  without, both bit-exact against the trainer's tensors at the end.

State: ``layers`` × 256 experts × 3 bf16 matrices of 32×64, a float32 norm per layer and two
bf16 tensors of 2^20 words; each version moves 1% of every bf16 tensor's words by 1–4 ulps
in place (the change rate of the real trajectory the other weight-sync suites use). Rows:
the whole state, and rank 0 of 4 of it as dim-0 pieces (``shards.dim0_pieces``). Numbers
are CPU seconds of this process per version (best of the versions after the first), over
the tensor count: µs per tensor, for the work the tensors' bytes need plus the per-tensor
overhead. One encode/decode thread, so the process's CPU time is the path's. Before each
version's clocks start, the heap the trainer's step left is settled (``settle_heap``).

How it scales: a laid-out version costs ``a·bytes + b·tensors + c·chunks``. ``a`` is the
compiled pass and the coding (the bytes' work), ``b`` what is left per tensor in Python (on
the publisher a name, dtype, shape and address check; on both sides the sums' hex and
digest), ``c`` a few array calls per chunk of 4 Mi words. At a fixed tensor size µs per
tensor is therefore flat in the tensor count, and grows with a tensor's bytes, not with
how many there are; a row at 12 layers (9k tensors) runs beside the 47-layer one (36k) to
show it.
"""

from __future__ import annotations

import io
import resource
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import markdown_table, progress, write_json

SUITE = "weight-sync-tensors"


def moe_state(layers: int, experts: int = 256, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {f"embed{k}": torch.randn(1 << 20, generator=g).to(torch.bfloat16) for k in range(2)}
    for layer in range(layers):
        for e in range(experts):
            for m in ("gate", "up", "down"):
                state[f"l{layer}.e{e}.{m}"] = torch.randn(32, 64, generator=g).to(torch.bfloat16)
        state[f"l{layer}.norm"] = torch.ones(64)
    return state


def step(state: dict[str, torch.Tensor], g: torch.Generator, density: float = 0.01) -> None:
    """Move ``density`` of every bf16 tensor's words by ±1–4 ulps, in place."""
    for t in state.values():
        if t.dtype != torch.bfloat16:
            continue
        bits = t.view(-1).view(torch.int16)
        k = int(bits.numel() * density)
        idx = torch.randint(0, bits.numel(), (k,), generator=g)
        moves = torch.randint(1, 5, (k,), generator=g, dtype=torch.int16)
        bits[idx] += moves * (torch.randint(0, 2, (k,), generator=g, dtype=torch.int16) * 2 - 1)


def settle_heap() -> None:
    """Let glibc tidy what the trainer's step freed, before a clock starts. ``step`` frees
    ~10^5 small tensors; glibc merges those free chunks (``malloc_consolidate``) at the
    process's next malloc of 1 KiB or more, on whichever thread makes it — measured at
    ~90 ms of CPU here, i.e. ~2.5 µs per tensor charged to the first path timed after the
    step (the laid-out publisher) and to neither of the others. One such malloc here."""
    bytearray(1 << 12)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(layers: int, versions: int, coding: int, sharded: bool) -> dict[str, Any]:
    from modal_rl.weightsync.codec.decode import apply_frame
    from modal_rl.weightsync.codec.encode import CodecConfig
    from modal_rl.weightsync.codec.held_layout import HeldLayout
    from modal_rl.weightsync.publisher import Publisher
    from modal_rl.weightsync.shards import dim0_pieces
    from modal_rl.weightsync.transport.base import FrameSink

    class Sink(FrameSink):
        def __init__(self) -> None:
            self.last = b""

        def send(self, header, records) -> int:
            self.last = b"".join(records)
            return len(self.last)

        def close(self) -> None:
            pass

    class PerTensorPublisher(Publisher):
        def _delta_layout(self) -> None:  # the per-tensor encoder, for the side-by-side rows
            return None

    trainer = moe_state(layers)
    view = (lambda: dict(dim0_pieces(trainer.items(), 0, 4))) if sharded else (lambda: trainer)
    config = CodecConfig(threads=1, coding=coding)
    settings = {"run": "bench", "epoch": 1, "anchor_every": None, "audit_every_s": None, "config": config}
    sinks = {"new": Sink(), "old": Sink()}
    pubs = {"new": Publisher(sinks["new"], **settings), "old": PerTensorPublisher(sinks["old"], **settings)}
    for pub in pubs.values():
        pub.publish(view())
    anchor = sinks["new"].last
    held = {}
    for kind in ("new", "old"):
        r = apply_frame({}, io.BytesIO(anchor), held_version=None, config=config, key=None)
        held[kind] = [r.state, dict(r.checksums), HeldLayout() if kind == "new" else None]
    g = torch.Generator().manual_seed(1)
    cpu: dict[str, list[float]] = {k: [] for k in ("pub_new", "pub_old", "rx_new", "rx_old")}
    identical = True
    for v in range(1, versions + 1):
        step(trainer, g)
        named = view()  # the trainer's pieces, made outside the publisher's time
        settle_heap()
        for kind, pub in pubs.items():
            c0 = _cpu()
            pub.publish(named)
            cpu[f"pub_{kind}"].append(_cpu() - c0)
        frame = sinks["new"].last
        identical &= frame == sinks["old"].last
        for kind, (state, sums, layout) in held.items():
            c0 = _cpu()
            r = apply_frame(
                state,
                io.BytesIO(frame),
                held_version=v - 1,
                held_checksums=sums,
                config=config,
                key=None,
                layout=layout,
            )
            cpu[f"rx_{kind}"].append(_cpu() - c0)
            held[kind][1] = dict(r.checksums)
    pieces = view()
    exact = all(
        torch.equal(state[name].view(-1).view(torch.int16), t.reshape(-1).view(torch.int16))
        for state, _, _ in held.values()
        for name, t in pieces.items()
        if t.dtype == torch.bfloat16
    )
    n = len(pieces)
    best = {k: min(xs[1:]) if len(xs) > 1 else xs[0] for k, xs in cpu.items()}
    row = {
        "state": "moe-dim0-rank0-of-4" if sharded else "moe",
        "tensors": n,
        "state_gb": sum(t.numel() * t.element_size() for t in pieces.values()) / 1e9,
        "coding": coding,
        "bytes_delta": len(frame),
        "frames_identical": identical,
        "bit_exact": exact,
        "load": Path("/proc/loadavg").read_text().split()[0],
    }
    for k, s in best.items():
        row[f"{k}_cpu_s"] = s
        row[f"per_tensor_us_{k}"] = s / n * 1e6
    return row


def run(quick: bool, out: Path) -> dict[str, Any]:
    versions = 3 if quick else 6
    # 47 layers: 36 145 tensors; 12 layers (9 230 tensors): how µs per tensor scales with the count
    cases = [(47, 1, False), (47, 1, True), (47, 2, False), (12, 1, False)]
    if not quick:
        cases.insert(3, (47, 2, True))
    rows = [
        measure(layers, versions, coding, sharded)
        for layers, coding, sharded in progress(cases, len(cases), SUITE)
    ]
    payload = {"quick": quick, "versions": versions, "rows": rows}
    write_json(out, SUITE, payload)
    headers = ["state", "tensors", "coding", "pub µs/t new", "pub µs/t old", "rx µs/t new", "rx µs/t old"]
    table = [
        [
            r["state"],
            r["tensors"],
            r["coding"],
            r["per_tensor_us_pub_new"],
            r["per_tensor_us_pub_old"],
            r["per_tensor_us_rx_new"],
            r["per_tensor_us_rx_old"],
        ]
        for r in rows
    ]
    print(markdown_table(headers, table))
    return payload
