"""GPU check of the weight-sync CUDA path: ``bash benchmarks/gpu_weight_sync.sh``.

Builds a bf16 state of ``--gb`` GB on the device, makes a new version with ``--density`` of
its words moved by ±1–2 ulps, and times, against the device's measured copy bandwidth:
diff (compare + nonzero on the device), gather (changed words to the host), the whole
encode (``encode_delta`` with ``TorchDiffer``), and decode + apply onto a device copy of
the base (host decode, device scatter, checksum verification). Prints a table and checks
the receiver ends bit-identical. Encode and decode run for both chunk codings: v1, and v2
(context-conditioned coding, which reads every held word of a chunk on the host: a device
copy of the whole state per sync, timed here against the copy bandwidth). Runs on the CPU
too (``--device cpu --gb 0.05``) as a smoke test of the script itself.
"""

from __future__ import annotations

import argparse
import io
import json
import time

import torch

from modal_rl.weightsync import CodecConfig, TorchDiffer, apply_frame, frame_bytes
from modal_rl.weightsync.codec.encode import encode_delta
from modal_rl.weightsync.transport.base import FrameSink


class _CountingSink(FrameSink):
    """Frames go nowhere; their size is counted (the publisher's own cost, no transport)."""

    def send(self, header, records) -> int:
        return sum(len(r) for r in records)

    def close(self) -> None:
        pass


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn, repeats: int = 1):
    best, out = float("inf"), None
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def make_states(gb: float, density: float, device: str, tensors: int = 32):
    per = int(gb * 1e9 / 2 / tensors)
    gen = torch.Generator(device=device).manual_seed(0)
    base, new = {}, {}
    for i in range(tensors):
        b = (torch.randn(per, device=device, generator=gen) * 0.02).to(torch.bfloat16)
        bits = b.view(torch.int16).clone()
        chosen = torch.rand(per, device=device, generator=gen) < density
        steps = torch.randint(1, 3, (per,), device=device, generator=gen, dtype=torch.int16)
        signs = torch.randint(0, 2, (per,), device=device, generator=gen, dtype=torch.int16) * 2 - 1
        bits = torch.where(chosen, bits + steps * signs, bits)
        base[f"layer.{i}.weight"] = b
        new[f"layer.{i}.weight"] = bits.view(torch.bfloat16)
    return base, new


def measure_copy(nbytes: int, device: str) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    seconds, _ = timed(device, lambda: dst.copy_(src), repeats=3)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=8.6)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--threads", type=int, default=16)
    args = parser.parse_args()
    dev = args.device
    base, new = make_states(args.gb, args.density, dev)
    nbytes = sum(t.numel() * 2 for t in base.values())
    rows = []

    copy_s = measure_copy(nbytes, dev)
    copy_gbps = 2 * nbytes / copy_s / 1e9  # bytes read + written
    rows.append(("device copy (read+write)", copy_s, copy_gbps))

    differ = TorchDiffer()
    handles = {k: (differ.prepare(base[k]), differ.prepare(new[k])) for k in base}

    def diff_only():
        return [torch.nonzero(torch.ne(b, n)).reshape(-1) for b, n in handles.values()]

    diff_s, positions = timed(dev, diff_only, repeats=2)
    rows.append(("diff (ne + nonzero)", diff_s, 2 * nbytes / diff_s / 1e9))

    def gather():
        return [(n[p].cpu(), b[p].cpu()) for (b, n), p in zip(handles.values(), positions, strict=True)]

    gather_s, _ = timed(dev, gather, repeats=2)
    changed = sum(int(p.numel()) for p in positions)
    rows.append(("gather changed words to host", gather_s, changed * 12 / gather_s / 1e9))

    # Load (or compile, on a fresh install) the v2 kernels outside the timed region.
    warm = {"w": base[next(iter(base))][:4096]}
    apply_frame(
        {"w": warm["w"].clone()},
        io.BytesIO(
            frame_bytes(encode_delta(warm, {"w": new[next(iter(new))][:4096]}, base_version=0, version=1))
        ),
        held_version=0,
        key=None,
    )
    frames, exact = {}, True
    for fmt in (1, 2):
        config = CodecConfig(threads=args.threads, coding=fmt)
        sums: dict[str, str] = {}
        encode_s, frame = timed(
            dev,
            lambda config=config, sums=sums: frame_bytes(
                encode_delta(
                    base, new, base_version=0, version=1, config=config, differ=differ, checksums_out=sums
                )
            ),
        )
        frames[fmt] = frame
        rows.append((f"v{fmt} encode (diff, gather, pack, checksums)", encode_s, nbytes / encode_s / 1e9))
        receiver = {k: v.clone() for k, v in base.items()}
        apply_s, _ = timed(
            dev,
            lambda config=config, receiver=receiver, frame=frame: apply_frame(
                receiver, io.BytesIO(frame), held_version=0, config=config, key=None
            ),
        )
        rows.append((f"v{fmt} decode + apply on device + verify", apply_s, nbytes / apply_s / 1e9))
        exact = exact and all(
            torch.equal(receiver[k].view(torch.int16), new[k].view(torch.int16)) for k in new
        )
    frame = frames[2]

    # The sharded path (weight-sync-scale's ranks on GPUs), as the product runs it: rank 0's
    # dim-0 shard through a real Publisher, its snapshot either on the device (diffed there,
    # only changed words and positions cross to the host) or in pinned host memory (the
    # shard copied device->host every version, diffed by the CPU kernels). One anchor first
    # (untimed), then the timed delta; the snapshot must end equal to the new shard.
    from modal_rl.weightsync.publisher import Publisher
    from modal_rl.weightsync.shards import dim0_pieces

    for world in (2, 4):
        shard_base = dict(dim0_pieces(base.items(), 0, world))
        shard_new = dict(dim0_pieces(new.items(), 0, world))
        shard_bytes = sum(t.numel() * 2 for t in shard_new.values())
        for place in ("device", "host"):
            publisher = Publisher(
                _CountingSink(),
                anchor_every=None,
                config=CodecConfig(threads=args.threads, coding=1),
                run="gpu-check",
                snapshot_on=place,
                audit_every_s=None,
            )
            publisher.publish(shard_base)
            shard_s, _ = timed(
                dev, lambda publisher=publisher, shard_new=shard_new: publisher.publish(shard_new)
            )
            label = (
                f"rank 0 of {world}: publish, snapshot {'on device' if place == 'device' else 'pinned host'}"
            )
            rows.append((label, shard_s, shard_bytes / shard_s / 1e9))
            exact = exact and all(
                torch.equal(publisher.snapshot[k].view(torch.int16).to(dev), shard_new[k].view(torch.int16))
                for k in shard_new
            )
            del publisher

    name = torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu"
    print(
        f"device: {name}; state {nbytes / 1e9:.2f} GB bf16 in {len(base)} tensors; density {changed / (nbytes / 2):.3%}"
    )
    print(f"{'phase':<42} {'seconds':>9} {'GB/s':>9} {'x copy time':>12}")
    for label, seconds, gbps in rows:
        print(f"{label:<42} {seconds:>9.4f} {gbps:>9.1f} {seconds / copy_s:>12.1f}")
    print(
        f"delta v1 {len(frames[1]):,} bytes, v2 {len(frame):,} bytes = {len(frame) / nbytes:.4%} of the bf16 state; bit-exact: {exact}"
    )
    print(
        json.dumps(
            {
                "device": name,
                "bytes": nbytes,
                "delta_bytes": len(frame),
                "delta_bytes_v1": len(frames[1]),
                "bit_exact": exact,
                "phases": {label: seconds for label, seconds, _ in rows},
            }
        )
    )
    if not exact:
        raise SystemExit("receiver is not bit-identical")


if __name__ == "__main__":
    main()
