"""Suite ``weight-sync-coder``: the v1 coder, in-place anchors and decode threads, side by side.

Three measurements, each old against new in one run on the same host (ratios are what to
read: the host is shared):

- ``coder``: coding a delta chunk's changes (gaps, byte planes, zstd-1 / rANS) with the
  numpy coder and with the compiled one (``codings.sparse_coder``), and with the compiled
  one as it was before the ``RANS0`` stream method (noisy planes to Huffman-only DEFLATE,
  the residual choice sampling 65536 changes), over a state of at least 50 M bf16 words
  (``--quick``: 8 M): tiles of one real Adam step of MiniLM (~0.6% of words change), in the
  encoder's 4 Mi-word chunks; CPU ns per changed word, one thread, the bytes of both
  compiled codings, whether the numpy and compiled bytes are identical, and decoding
  (``chunks.decode_chunk``) the bodies of both codings, ns per changed word.
- ``anchors``: a receiver following versions with an anchor every 4 (``anchor_every=4``),
  each version 1% of words moved by 1–4 ulps at uniform positions (the receiver applies every
  delta, so an anchor differs from the held state by one version: ~1% of words), at several
  state sizes (``ANCHOR_TILES``); per size and mode a fresh child process, its RSS once the
  codec is warm (``receiver_fixed_gb``) and its peak RSS at each frame (``/proc/self/clear_refs``
  resets the peak), with anchors written in place over the held tensors (``anchor_inplace``)
  against anchors decoded into fresh tensors (the held state kept beside them, as a receiver
  that swaps after verifying does). A least-squares fit over the sizes splits the steady
  anchors' peak into a part proportional to the held state and a fixed part.
- ``threads``: applying the same delta frames with 1 and with 2 decode threads, and
  encoding them with 1 and 2 encode threads (wall seconds per version).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SUITE = "weight-sync-coder"
CHUNK = 1 << 22
# state sizes of the anchors measurement, in tiles of MiniLM (45 MB of bf16 each)
ANCHOR_TILES_QUICK = (1, 4, 8)
ANCHOR_TILES = (1, 4, 8, 16)


def _states(words: int, versions: int):
    """bf16 states of ``words`` words (tiled MiniLM weights, one flat tensor per tile), each
    version 1% of words moved from the previous one."""
    import torch

    from benchmarks._weight_sync_data import pretrained_bf16, synthetic_update

    flat = torch.cat([t.reshape(-1) for t in pretrained_bf16().values()])
    tiles = -(-words // flat.numel())
    base = {f"tile{k}": flat.clone() for k in range(tiles)}
    out = [base]
    for v in range(1, versions):
        out.append(synthetic_update(out[-1], 0.01, seed=v))
    return out


def measure_coder(words: int) -> dict[str, Any]:
    import numpy as np

    from benchmarks._weight_sync_data import adam_trajectory
    from modal_rl.weightsync.codec.codings import chunks, sparse_coder
    from modal_rl.weightsync.codec.diffwords import diff_words
    from modal_rl.weightsync.codec.dtypes import words_of
    from modal_rl.weightsync.codec.streams import HUFFMAN

    real = adam_trajectory(1e-6, [0, 1])  # one real Adam step: ~0.6% of bf16 words move
    flat = [np.concatenate([words_of(t) for t in real[v].values()]) for v in (0, 1)]
    tiles = -(-words // flat[0].size)
    jobs = []
    for _ in range(tiles):  # each tile is the real step's words, coded chunk by chunk
        b, n = flat
        for lo in range(0, b.size, CHUNK):
            pos, old, nw = diff_words(b[lo : lo + CHUNK], n[lo : lo + CHUNK])
            jobs.append((chunks.ChunkSpec(len(jobs), 0, min(CHUNK, b.size - lo)), pos, old, nw))
    changed = sum(j[1].size for j in jobs)
    total = sum(j[0].elem_count for j in jobs)
    compiled, noisy, sample = chunks._compiled_coder, chunks.SPARSE_NOISY, sparse_coder.SAMPLE
    modes = {  # (compiled coder, noisy planes' coder, residual choice's sample)
        "numpy": (lambda o, n: None, noisy, sample),
        "previous": (compiled, HUFFMAN, 1 << 16),
        "compiled": (compiled, noisy, sample),
    }

    def coded(mode: str):
        chunks._compiled_coder, chunks.SPARSE_NOISY, sparse_coder.SAMPLE = modes[mode]
        try:
            t0 = time.process_time()
            bodies = [chunks.encode_delta_chunk(spec, p, o, n, 1) for spec, p, o, n in jobs]
            return time.process_time() - t0, bodies
        finally:
            chunks._compiled_coder, chunks.SPARSE_NOISY, sparse_coder.SAMPLE = compiled, noisy, sample

    def decoded(bodies: list[bytes]) -> float:
        t0 = time.process_time()
        for body in bodies:
            chunks.decode_chunk(body, 2, CHUNK)
        return time.process_time() - t0

    for mode in modes:  # compile (cached on disk) before timing
        decoded(coded(mode)[1][:1])
    best = dict.fromkeys(modes, float("inf"))
    best_decode = {"previous": float("inf"), "compiled": float("inf")}
    bodies = {}
    for _ in range(5):  # interleaved, best of 5: the host is shared
        for mode in modes:
            s, bodies[mode] = coded(mode)
            best[mode] = min(best[mode], s)
        for mode in best_decode:
            best_decode[mode] = min(best_decode[mode], decoded(bodies[mode]))
    return {
        "words": total,
        "changed": changed,
        "ns_per_changed_numpy": 1e9 * best["numpy"] / changed,
        "ns_per_changed_previous": 1e9 * best["previous"] / changed,
        "ns_per_changed_compiled": 1e9 * best["compiled"] / changed,
        "speedup": best["numpy"] / best["compiled"],
        "speedup_over_previous": best["previous"] / best["compiled"],
        "bytes_previous": sum(map(len, bodies["previous"])),
        "bytes": sum(map(len, bodies["compiled"])),
        "identical": bodies["numpy"] == bodies["compiled"],
        "decode_ns_per_changed_previous": 1e9 * best_decode["previous"] / changed,
        "decode_ns_per_changed": 1e9 * best_decode["compiled"] / changed,
    }


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _child_anchors(folder: Path, mode: str, versions: int) -> dict[str, Any]:
    """Follow the frames in ``folder``; the process's peak RSS at each frame, and above what
    it held before that frame. ``fixed_bytes``: its RSS once the codec is warm, before the
    first frame (interpreter, torch, numba and its kernels, the worker pool)."""
    import gc

    from modal_rl.weightsync.codec import anchor_inplace
    from modal_rl.weightsync.codec.decode import apply_frame
    from modal_rl.weightsync.codec.encode import CodecConfig
    from modal_rl.weightsync.codec.warmup import warm_up

    undo: list[int] = []  # the in-place anchors' undo log, body by body (list.append: thread-safe)
    plain = anchor_inplace.apply_full_chunk

    def counted(segments, in_place, chunk, log) -> None:
        plain(segments, in_place, chunk, lambda body: undo.append(len(body)) or log(body))

    anchor_inplace.apply_full_chunk = counted
    config = CodecConfig(threads=2)
    warm_up(config.threads)
    gc.collect()
    fixed = _vm("VmRSS")
    state: dict[str, Any] = {}
    checksums: dict[str, str] = {}
    held_version = None
    extra = []
    for v in range(versions):
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        before = _vm("VmRSS")
        with open(folder / f"v{v}.frame", "rb") as stream:
            # fresh: an anchor (every 4th frame) is built beside what is held
            target = {} if mode == "fresh" and v % 4 == 0 else state
            result = apply_frame(
                target, stream, held_version=held_version, held_checksums=checksums, config=config, key=None
            )
        peak = _vm("VmHWM")
        kind = result.header.kind
        if result.state is not None:
            state = result.state
        held_version, checksums = result.header.version, dict(result.checksums)
        extra.append(
            {
                "version": v,
                "kind": kind,
                "extra_bytes": peak - before,
                "peak_bytes": peak,
                "undo_bytes": sum(undo),
            }
        )
        undo.clear()
    held = sum(t.numel() * t.element_size() for t in state.values())
    return {"mode": mode, "held_bytes": held, "fixed_bytes": fixed, "frames": extra}


def _write_frames(folder: Path, tiles: int, versions: int) -> list[int]:
    """An anchor every 4 versions, deltas between, of a state of ``tiles`` tiles; two
    versions in memory at a time. Returns the frames' sizes."""
    import torch

    from benchmarks._weight_sync_data import pretrained_bf16, synthetic_update
    from modal_rl.weightsync.codec.encode import CodecConfig, encode_anchor, encode_delta

    flat = torch.cat([t.reshape(-1) for t in pretrained_bf16().values()])
    config = CodecConfig(threads=2)
    previous, state = None, {f"tile{k}": flat.clone() for k in range(tiles)}
    sizes = []
    for v in range(versions):
        if v:
            previous, state = state, synthetic_update(state, 0.01, seed=v)
        if v % 4 == 0:
            frame = encode_anchor(state, version=v, config=config)
        else:
            frame = encode_delta(previous, state, base_version=v - 1, version=v, config=config)
        with open(folder / f"v{v}.frame", "wb") as f:
            sizes.append(sum(f.write(r) for r in frame))
    return sizes


def anchor_row(child: dict[str, Any], tiles: int) -> dict[str, Any]:
    """One (size, mode) row: the steady anchors are every anchor after the first (which
    builds the state from nothing); their worst peak is the row's."""
    frames = child["frames"]
    steady = [f for f in frames if f["kind"] == "anchor"][1:]
    worst = max(steady, key=lambda f: f["peak_bytes"])
    return {
        "mode": child["mode"],
        "tiles": tiles,
        "anchor_every": 4,
        "held_gb": child["held_bytes"] / 1e9,
        "peak_rss_receiver_gb": worst["peak_bytes"] / 1e9,
        "receiver_fixed_gb": child["fixed_bytes"] / 1e9,
        "anchor_extra_gb": max(f["extra_bytes"] for f in steady) / 1e9,
        "worst_delta_extra_gb": max(f["extra_bytes"] for f in frames if f["kind"] == "delta") / 1e9,
        "undo_log_gb": max(f["undo_bytes"] for f in steady) / 1e9,
        "frames": frames,
    }


def fit(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Least squares over the rows' sizes (GB): ``peak = proportional x held + fixed``, the
    process's peak RSS; and ``extra = extra_proportional x held + extra_fixed``, the steady
    anchor's peak above what the process held before it. ``fixed_gb_worst_row``: the largest
    fixed part any row needs at the fitted proportion."""
    import numpy as np

    held = np.array([r["held_gb"] for r in rows])
    peak = np.array([r["peak_rss_receiver_gb"] for r in rows])
    slope, intercept = np.polyfit(held, peak, 1)
    extra_slope, extra_intercept = np.polyfit(held, np.array([r["anchor_extra_gb"] for r in rows]), 1)
    return {
        "proportional": float(slope),
        "fixed_gb": float(intercept),
        "fixed_gb_worst_row": max(float(p - slope * h) for h, p in zip(held, peak, strict=True)),
        "extra_proportional": float(extra_slope),
        "extra_fixed_gb": float(extra_intercept),
    }


def measure_anchors(folder: Path, tile_counts: tuple[int, ...], versions: int = 13) -> dict[str, Any]:
    """Per state size: frames written once, then each mode in its own child process (a
    fresh interpreter per size and mode, so no peak carries over)."""
    rows: list[dict[str, Any]] = []
    sizes = {}
    for tiles in tile_counts:
        where = folder / f"tiles{tiles}"
        where.mkdir()
        sizes[tiles] = _write_frames(where, tiles, versions)
        for mode in ("fresh", "inplace"):
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.weight_sync_coder",
                    "anchors",
                    str(where),
                    mode,
                    str(versions),
                ],
                check=True,
                capture_output=True,
                text=True,
                env=os.environ | {"MODAL_RL_RUN_KEY": ""},
            )
            rows.append(anchor_row(json.loads(out.stdout.strip().splitlines()[-1]), tiles))
        for frame in where.iterdir():
            frame.unlink()
    fits = {mode: fit([r for r in rows if r["mode"] == mode]) for mode in ("fresh", "inplace")}
    return {"anchor_every": 4, "frame_bytes": sizes, "rows": rows, "fit": fits}


def measure_threads(words: int, versions: int = 4) -> dict[str, Any]:
    from modal_rl.weightsync.chain import VersionChain, frame_bytes
    from modal_rl.weightsync.codec.encode import CodecConfig, encode_anchor, encode_delta

    states = _states(words, versions)
    out: dict[str, Any] = {}
    frames = None
    for threads in (1, 2, 1, 2):  # interleaved; the best of the two runs counts
        config = CodecConfig(threads=threads, window=2 * max(threads, 2))
        made = [frame_bytes(encode_anchor(states[0], version=0, config=config))]
        t1 = time.perf_counter()
        made += [
            frame_bytes(encode_delta(states[v - 1], states[v], base_version=v - 1, version=v, config=config))
            for v in range(1, versions)
        ]
        encode_s = (time.perf_counter() - t1) / (versions - 1)
        frames = frames or made
        chain = VersionChain(config, retain=False, key=None)
        chain.apply(frames[0])
        t2 = time.perf_counter()
        for frame in frames[1:]:
            chain.apply(frame)
        decode_s = (time.perf_counter() - t2) / (versions - 1)
        best = out.setdefault(threads, {"encode_s": encode_s, "decode_s": decode_s})
        best["encode_s"], best["decode_s"] = min(best["encode_s"], encode_s), min(best["decode_s"], decode_s)
    return {"words": sum(t.numel() for t in states[0].values()), "per_threads": out}


def run(quick: bool, out: Path) -> dict[str, Any]:
    import tempfile

    from modal_rl.progress import phase

    words = 8_000_000 if quick else 50_000_000
    result: dict[str, Any] = {"load": Path("/proc/loadavg").read_text().split()[:3]}
    with phase("coder: numpy vs compiled", prefix=f"[{SUITE}] "):
        result["coder"] = measure_coder(words)
    with (
        tempfile.TemporaryDirectory(prefix="mrl-coder-", dir=out) as folder,
        phase("anchors: fresh vs in place", prefix=f"[{SUITE}] "),
    ):
        result["anchors"] = measure_anchors(Path(folder), ANCHOR_TILES_QUICK if quick else ANCHOR_TILES)
    with phase("threads: 1 vs 2", prefix=f"[{SUITE}] "):
        result["threads"] = measure_threads(words // 2)
    result["load_after"] = Path("/proc/loadavg").read_text().split()[:3]
    (out / "weight-sync-coder.json").write_text(json.dumps(result, indent=2))
    print(render(result))
    return result


def render(result: dict[str, Any]) -> str:
    c = result["coder"]
    lines = [
        f"coder over {c['words'] / 1e6:.0f} M words, {c['changed']} changed: numpy "
        f"{c['ns_per_changed_numpy']:.1f} ns/changed word, compiled {c['ns_per_changed_compiled']:.1f} "
        f"({c['speedup']:.2f}x), bytes identical: {c['identical']}",
        f"coder, previous (Huffman planes) -> now (rANS planes): {c['ns_per_changed_previous']:.1f} -> "
        f"{c['ns_per_changed_compiled']:.1f} ns/changed word ({c['speedup_over_previous']:.2f}x), bytes "
        f"{c['bytes_previous']} -> {c['bytes']} ({c['bytes'] / c['bytes_previous']:.3f}x); decode "
        f"{c['decode_ns_per_changed_previous']:.1f} -> {c['decode_ns_per_changed']:.1f} ns/changed word",
    ]
    a = result["anchors"]
    for row in a["rows"]:
        lines.append(
            f"anchors every 4 ({row['mode']}): held {row['held_gb'] * 1e3:.0f} MB, receiver peak "
            f"{row['peak_rss_receiver_gb'] * 1e3:.0f} MB (fixed {row['receiver_fixed_gb'] * 1e3:.0f} MB); "
            f"steady anchor above held {row['anchor_extra_gb'] * 1e3:.1f} MB, worst delta "
            f"{row['worst_delta_extra_gb'] * 1e3:.1f} MB, undo log {row['undo_log_gb'] * 1e3:.1f} MB"
        )
    for mode, f in a["fit"].items():
        lines.append(
            f"anchors ({mode}) fit: peak = {f['proportional']:.3f} x held + {f['fixed_gb'] * 1e3:.0f} MB "
            f"(worst row's fixed part {f['fixed_gb_worst_row'] * 1e3:.0f} MB); above what it held before: "
            f"{f['extra_proportional']:.3f} x held + {f['extra_fixed_gb'] * 1e3:.0f} MB"
        )
    t = result["threads"]["per_threads"]
    lines.append(
        f"threads over {result['threads']['words'] / 1e6:.0f} M words: encode 1: {t[1]['encode_s']:.3f} s, "
        f"2: {t[2]['encode_s']:.3f} s ({t[1]['encode_s'] / t[2]['encode_s']:.2f}x); decode 1: "
        f"{t[1]['decode_s']:.3f} s, 2: {t[2]['decode_s']:.3f} s ({t[1]['decode_s'] / t[2]['decode_s']:.2f}x)"
    )
    lines.append(f"load before {' '.join(result['load'])}, after {' '.join(result['load_after'])}")
    return "\n".join(lines)


if __name__ == "__main__" and sys.argv[1:2] == ["anchors"]:
    print(json.dumps(_child_anchors(Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]))))
