"""Maintainers' CLI: encode, apply and inspect weight-sync frames with safetensors files.

    python -m modal_rl.weightsync encode --base A.safetensors --new B.safetensors --out D
    python -m modal_rl.weightsync encode --new B.safetensors --out D          (an anchor)
    python -m modal_rl.weightsync apply --base A.safetensors --delta D --out C.safetensors
    python -m modal_rl.weightsync inspect D

Frames are signed (encode) and verified (apply, receive) with the run's key from
``MODAL_RL_RUN_KEY``; ``--keyless`` reads and writes unsigned frames instead. ``inspect``
verifies too when the key is set; without it, it reads the headers as they are and says so. The key is
never taken from the command line (it would show in ``ps``).

Every failure is one line on stderr, no traceback: bad input (a missing file or output
directory, a file that is not safetensors or not a frame, a frame refused for the given base —
wrong base, mismatched shapes, truncated, corrupt or forged — a missing key) exits 2, like the
launchers; a run that fails (``receive``: nothing to connect to, the version never came)
exits 1; Ctrl-C exits 130. No output file is left behind: outputs are written to a
temporary file beside the target and renamed into place only after everything succeeded.
An output's directory must exist (a typo does not silently create directories).

``encode`` stamps frames with the run (the key's fingerprint) and a fresh epoch (``--epoch``
to choose one), like a publisher.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from modal_rl.run_key import MissingRunKeyError
from modal_rl.weightsync.cli.common import BAD_INPUT, FAILED, CliError, add_key_flag, check_out, keys_of  # noqa: F401
from modal_rl.weightsync.codec.decode import apply_frame
from modal_rl.weightsync.codec.differ import NumpyDiffer
from modal_rl.weightsync.codec.encode import CodecConfig, encode_anchor, encode_delta
from modal_rl.weightsync.errors import WeightSyncError
from modal_rl.weightsync.wire.auth import FrameKeys, sign_records, trailer_size
from modal_rl.weightsync.wire.chunk_header import CHUNK_HEADER, ENCODING_NAMES
from modal_rl.weightsync.wire.dtype_codes import ITEMSIZE
from modal_rl.weightsync.wire.frames import (
    MAGIC,
    RECORD_HEADER,
    TAG_CHUNK,
    TAG_GROUP,
    TAG_VERSION,
    GroupHeader,
    VersionHeader,
    read_records,
    split_records,
)


def load_safetensors(path: Path) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    need_file(path, "a safetensors file")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CliError(f"{path}: not a readable safetensors file ({exc})") from exc


def need_file(path: Path, what: str) -> None:
    """One line when ``path`` is not a readable file: missing, or a directory."""
    if path.is_dir():
        raise CliError(f"{path} is a directory; pass {what} (e.g. {path}/model.safetensors)")
    if not path.is_file():
        raise CliError(f"{path}: no such file; pass {what}")


def frame_problem(path: Path, exc: Exception) -> CliError:
    """A frame the codec refused, named with the file and what to do about it."""
    from modal_rl.weightsync.errors import TruncatedFrameError

    if isinstance(exc, TruncatedFrameError):
        return CliError(f"{path}: the frame is cut short ({exc}); copy it again or re-run `encode`")
    return CliError(f"{path}: {exc}")


def write_atomically(out: Path, write: Callable[[Path], None]) -> None:
    check_out(out)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cmd_encode(args: argparse.Namespace) -> int:
    from modal_rl.weightsync.wire.auth import run_id_of
    from modal_rl.weightsync.wire.epoch import new_epoch
    from modal_rl.weightsync.wire.frames import stamp

    check_out(args.out)
    keys = keys_of(args)
    config = CodecConfig(chunk_elems=args.chunk_elems, threads=args.threads, zstd_level=args.level)
    new = load_safetensors(args.new)
    if args.base is None:
        records = encode_anchor(new, version=args.version, config=config)
    else:
        base = load_safetensors(args.base)
        records = encode_delta(base, new, base_version=args.base_version, version=args.version, config=config)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            epoch = args.epoch if args.epoch is not None else new_epoch()
            for rec in sign_records(stamp(records, run_id_of(keys), epoch), keys):
                f.write(rec)

    write_atomically(args.out, write)
    info = inspect_frame(args.out.read_bytes(), keys)
    versions = f"{args.base_version} -> {args.version}" if args.base is not None else f"anchor {args.version}"
    print(
        f"wrote {args.out}: {info['kind']} {versions}, {info['tensors']} tensors, "
        f"{info['changed']} of {info['elements']} words changed ({info['density']:.2%}), "
        f"{info['frame_bytes']} bytes for {info['raw_bytes']} raw (ratio {info['ratio']:.1f}x)"
    )
    return 0


def cmd_apply(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    check_out(args.out)
    keys = keys_of(args)
    state = load_safetensors(args.base)
    need_file(args.delta, "a frame written by `encode`")
    data = args.delta.read_bytes()
    check_is_frame(args.delta, data)
    try:
        header = _first_header(data, keys)
        missing = sorted(set(frame_tensors(data)) - set(state)) if header.kind == "delta" else []
    except WeightSyncError as exc:
        raise frame_problem(args.delta, exc) from None
    if missing:
        more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CliError(
            f"{args.base} has no tensor {missing[0]!r}{more}, which {args.delta} changes; "
            "pass the base the delta was encoded against"
        )
    # The base file carries no version; the base checksums in the delta decide whether it fits.
    held = {name: NumpyDiffer().checksum(NumpyDiffer().prepare(t)) for name, t in state.items()}
    config = CodecConfig(threads=args.threads)
    try:
        result = apply_frame(
            state,
            io.BytesIO(data),
            held_version=header.base_version,
            held_checksums=held,
            config=config,
            key=keys,
        )
    except WeightSyncError as exc:
        raise frame_problem(args.delta, exc) from None
    out_state = result.state if result.state is not None else state
    write_atomically(args.out, lambda tmp: save_file(out_state, str(tmp)))
    print(f"wrote {args.out}: version {header.version}, {result.changed_words} words changed, verified")
    return 0


def _first_header(data: bytes, keys: FrameKeys | None) -> VersionHeader:
    for tag, body in read_records(io.BytesIO(data), keys=keys):
        if tag != TAG_VERSION:
            break
        return VersionHeader.from_body(body)
    raise CliError("not a weight-sync frame (no version header)")


def unverified_records(data: bytes):
    """``(tag, body)`` of each record, signatures and checksums not checked: for reading a
    frame's headers without the run key (``inspect``); never used to apply anything."""
    for tag, raw in split_records(io.BytesIO(data)):
        _, length = RECORD_HEADER.unpack_from(raw, 0)
        yield tag.upper(), raw[RECORD_HEADER.size : RECORD_HEADER.size + length]


def frame_tensors(data: bytes) -> list[str]:
    """The tensor names a frame's group headers list (read without verifying)."""
    return [
        t.name
        for tag, body in unverified_records(data)
        if tag == TAG_GROUP
        for t in GroupHeader.from_body(body).tensors
    ]


def inspect_frame(data: bytes, keys: FrameKeys | None, verify: bool = True) -> dict[str, Any]:
    """Sizes and densities of a frame, read from its headers (no decoding; every record
    verified, see ``read_records``, unless ``verify`` is false). One row per group: a large
    tensor is a group of its own; small neighbours share one."""
    header, groups, current = None, [], None
    overhead = RECORD_HEADER.size + (trailer_size(data[:1]) if data else 0)
    records = read_records(io.BytesIO(data), keys=keys) if verify else unverified_records(data)
    for tag, body in records:
        if tag == TAG_VERSION:
            header = VersionHeader.from_body(body)
        elif tag == TAG_GROUP:
            gh = GroupHeader.from_body(body)
            names = [t.name for t in gh.tensors]
            label = names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1} more)"
            current = {"name": label, "tensors": names, "dtype": gh.tensors[0].dtype, "elements": gh.total}
            current |= {"changed": 0, "bytes": len(body) + overhead, "encodings": {}}
            groups.append(current)
        elif tag == TAG_CHUNK and current is not None:
            _, _, nchanged, encoding, _ = CHUNK_HEADER.unpack_from(body, 0)
            current["changed"] += nchanged
            current["bytes"] += len(body) + overhead
            name = ENCODING_NAMES.get(encoding, str(encoding))
            current["encodings"][name] = current["encodings"].get(name, 0) + 1
    if header is None:
        raise CliError("not a weight-sync frame (no version header)")
    raw = sum(g["elements"] * ITEMSIZE[g["dtype"]] for g in groups)
    elements = sum(g["elements"] for g in groups)
    changed = sum(g["changed"] for g in groups)
    for g in groups:
        g["density"] = g["changed"] / g["elements"] if g["elements"] else 0.0
    return {
        "kind": header.kind,
        "version": header.version,
        "base_version": header.base_version,
        "run": header.run,
        "epoch": header.epoch,
        "groups": groups,
        "tensors": sum(len(g["tensors"]) for g in groups),
        "elements": elements,
        "changed": changed,
        "density": changed / elements if elements else 0.0,
        "frame_bytes": len(data),
        "raw_bytes": raw,
        "ratio": raw / len(data) if data else 0.0,
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    from modal_rl.run_key import RUN_KEY_ENV

    need_file(args.frame, "a frame written by `encode`")
    data = args.frame.read_bytes()
    check_is_frame(args.frame, data)
    # Headers need no key: with the run key in the environment (or --keyless) every record is
    # verified; without it the headers are read as they are and the output says so.
    verify = args.keyless or bool(os.environ.get(RUN_KEY_ENV))
    try:
        info = inspect_frame(data, keys_of(args) if verify else None, verify=verify)
    except WeightSyncError as exc:
        raise frame_problem(args.frame, exc) from None
    info["verified"] = verify
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    base = f" (base {info['base_version']})" if info["kind"] == "delta" else ""
    print(
        f"{info['kind']} version {info['version']}{base}: {info['tensors']} tensors in {len(info['groups'])} groups"
    )
    print(f"{'tensor':<48} {'dtype':<14} {'elements':>12} {'density':>9} {'bytes':>12}")
    for t in info["groups"]:
        print(
            f"{t['name'][:48]:<48} {t['dtype']:<14} {t['elements']:>12} {t['density']:>9.4%} {t['bytes']:>12}"
        )
    print(
        f"total: {info['elements']} elements, density {info['density']:.4%}, "
        f"{info['frame_bytes']} bytes for {info['raw_bytes']} raw (ratio {info['ratio']:.1f}x)"
    )
    if not verify:
        print(f"(headers read without checking signatures: {RUN_KEY_ENV} is not set)")
    return 0


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (``modal_rl.cli_errors.OneLineParser``), with a hint for a
    subcommand's flag given before the subcommand; subparsers inherit the class."""

    def error(self, message: str):
        misplaced = [f for f in ("--keyless", "--json") if f in message.split()]
        if "unrecognized arguments" in message and self.prog == PROG and misplaced:
            message += f"; {misplaced[0]} goes after the subcommand (e.g. inspect D {misplaced[0]})"
        self.exit(BAD_INPUT, f"error: {message} (see {self.prog} --help)\n")


PROG = "python -m modal_rl.weightsync"
# A frame's first record is its version header: tag V (v when signed), length, then MAGIC.
FRAME_MAGIC = slice(RECORD_HEADER.size, RECORD_HEADER.size + len(MAGIC))


def check_is_frame(path: Path, data: bytes) -> None:
    """A frame starts with its V record: anything else (a safetensors file, say) is named as
    what it is instead of as a corrupt record."""
    if data[:1] not in (TAG_VERSION, TAG_VERSION.lower()) or data[FRAME_MAGIC] != MAGIC:
        what = "a safetensors file" if path.suffix == ".safetensors" else "this file"
        raise CliError(
            f"{path} is not a weight-sync frame ({what} does not start with a version record); "
            "pass a frame written by `encode`"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    enc = sub.add_parser("encode", help="encode a delta (with --base) or an anchor (without)")
    enc.add_argument("--base", type=Path, help="base version (safetensors); omit for a full anchor")
    enc.add_argument("--new", type=Path, required=True, help="new version (safetensors)")
    enc.add_argument("--out", type=Path, required=True, help="frame to write")
    enc.add_argument("--base-version", type=int, default=0)
    enc.add_argument("--version", type=int, default=1)
    enc.add_argument("--chunk-elems", type=int, default=CodecConfig.chunk_elems)
    enc.add_argument("--threads", type=int, default=CodecConfig.threads)
    enc.add_argument("--level", type=int, default=CodecConfig.zstd_level, help="zstd level")
    enc.add_argument("--epoch", type=int, help="the epoch to stamp (default: a fresh one)")
    add_key_flag(enc)
    enc.set_defaults(fn=cmd_encode)
    app = sub.add_parser("apply", help="apply a frame onto a base; writes the verified result")
    app.add_argument("--base", type=Path, required=True)
    app.add_argument("--delta", type=Path, required=True)
    app.add_argument("--out", type=Path, required=True)
    app.add_argument("--threads", type=int, default=CodecConfig.threads)
    add_key_flag(app)
    app.set_defaults(fn=cmd_apply)
    ins = sub.add_parser("inspect", help="density, bytes per tensor and ratio of a frame")
    ins.add_argument("frame", type=Path)
    ins.add_argument("--json", action="store_true")
    add_key_flag(ins)
    ins.set_defaults(fn=cmd_inspect)
    from modal_rl.weightsync.cli.receive import add_parser as add_receive

    add_receive(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # usage errors: argparse's one line, exit 2
    try:
        return args.fn(args)
    except BrokenPipeError:
        # The reader went away (`| head`): nothing more to say. Point stdout at /dev/null so
        # the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    except (WeightSyncError, ValueError, MissingRunKeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    except OSError as exc:  # a file that cannot be read or written
        print(f"error: {exc.filename or ''}: {exc.strerror or exc}".replace(": : ", ": "), file=sys.stderr)
        return BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:  # torch, for the safetensors files of encode and apply
        from modal_rl.cli_errors import missing_extra

        line = missing_extra(exc)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return BAD_INPUT
