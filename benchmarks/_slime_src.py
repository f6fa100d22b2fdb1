"""slime's own disk-delta code, measured on the weight-sync cases (``--slime-src DIR``).

Given a slime checkout, this imports slime's trainer-side encoder
(``slime/backends/megatron_utils/update_weight/update_weight_from_disk_delta.py``, whose
``_encode_delta`` runs ``diff_and_compress`` over every tensor) and the engine-side apply
(``local_checkpoint.py``, carried as a new file inside ``docker/patch/latest/
sglang-pull_weights.patch``) straight from DIR, and runs them on the same (base, new) states
as our codec: no re-implementation of slime's format is involved.

Stubbed, because it cannot run on a CPU host (nothing else is):
- ``megatron.core.mpu``: this process is the only rank (DP = TP = 0, the PP-source rank);
- ``UpdateWeightFromDistributed`` (the NCCL base class, needs Megatron and SGLang): only its
  constructor's bookkeeping (``args``, ``weight_version``, ``update_weight_metrics``);
- ``ray.get``: there are no engine actors; the engine-side pull is called directly;
- the Megatron gather (``_iter_hf_tensors``): yields the case's new tensors.
torch.distributed is real: a one-rank gloo group. Pinned host buffers need an accelerator,
so slime takes its own pageable ``.cpu()`` fallback.

Encodings: ``xor`` (slime's default) always; ``sparse`` when the checkout has it (the
``patches/slime`` series applied). slime's apply takes ``sparse`` from SGLang's own
``sglang.srt.weight_sync.delta_decoders``; SGLang is not installed here, so that module is the
new file of the ``patches/sglang`` series, read out of the patch and registered under its
name while a :class:`SlimeSource` is entered (an SGLang that already has it is used as is).
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import sys
import tempfile
import time
import types
from argparse import Namespace
from pathlib import Path
from typing import Any

import numpy as np

PACKAGE = "slime.backends.megatron_utils.update_weight"
DECODERS_MODULE = "sglang.srt.weight_sync.delta_decoders"
APPLY_PATCH = Path("docker/patch/latest/sglang-pull_weights.patch")
CHECKSUM = "xxh3-128"  # slime's default


class SlimeSourceError(RuntimeError):
    """The directory is not a slime checkout this module can measure."""


def _stub_modules(src: Path) -> dict[str, types.ModuleType]:
    megatron, core = types.ModuleType("megatron"), types.ModuleType("megatron.core")
    core.mpu = types.SimpleNamespace(
        get_data_parallel_rank=lambda with_context_parallel=False: 0,
        get_tensor_model_parallel_rank=lambda: 0,
    )
    megatron.core = core
    utils_pkg = types.ModuleType("slime.backends.megatron_utils")
    utils_pkg.__path__ = [str(src / "slime" / "backends" / "megatron_utils")]
    update_pkg = types.ModuleType(PACKAGE)
    update_pkg.__path__ = [str(src / "slime" / "backends" / "megatron_utils" / "update_weight")]
    base = types.ModuleType(f"{PACKAGE}.update_weight_from_distributed")

    class UpdateWeightFromDistributed:
        def __init__(self, args, model, weights_getter, *, model_name, quantization_config):
            self.args, self.weight_version, self.update_weight_metrics = args, 0, {}

    base.UpdateWeightFromDistributed = UpdateWeightFromDistributed
    return {
        "megatron": megatron,
        "megatron.core": core,
        utils_pkg.__name__: utils_pkg,
        PACKAGE: update_pkg,
        base.__name__: base,
    }


def load_encoder_module(src: Path) -> types.ModuleType:
    """slime's ``update_weight_from_disk_delta`` from ``src`` (see the module doc for stubs)."""
    path = (
        src / "slime" / "backends" / "megatron_utils" / "update_weight" / "update_weight_from_disk_delta.py"
    )
    if not path.is_file():
        raise SlimeSourceError(f"{src} is not a slime checkout with disk delta sync ({path} missing)")
    loaded = sys.modules.get("slime")
    if loaded is not None and Path(loaded.__path__[0]).resolve() != (src / "slime").resolve():
        raise SlimeSourceError(f"another slime is already imported from {loaded.__path__[0]}")
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
    sys.modules.update(_stub_modules(src))
    name = f"{PACKAGE}.update_weight_from_disk_delta"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    module.ray = types.SimpleNamespace(get=list)  # no engine actors; see the module doc
    # its one warning here is the pinned-buffer fallback the module doc explains, once per encode
    logging.getLogger(module.__name__).setLevel(logging.ERROR)
    return module


def load_apply_module(src: Path, workdir: Path) -> types.ModuleType:
    """The engine-side ``local_checkpoint`` module, taken out of slime's SGLang patch."""
    from slime_modal.upstream import extract_engine_apply

    try:
        source = extract_engine_apply((src / APPLY_PATCH).read_text())
    except (OSError, ValueError) as exc:
        raise SlimeSourceError(f"{src / APPLY_PATCH}: no usable engine apply ({exc})") from None
    target = workdir / "slime_local_checkpoint.py"
    target.write_text(source)
    spec = importlib.util.spec_from_file_location("slime_local_checkpoint", target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_sglang_decoders(workdir: Path) -> types.ModuleType:
    """SGLang's delta decoders as ``patches/sglang`` adds them (the whole new file)."""
    from patches import series_path
    from patches.series import load
    from slime_modal.upstream import DECODERS, extract_new_file

    for patch in load(series_path("sglang")).patches:
        text = patch.file.read_text()
        if f"+++ b/{DECODERS}\n" in text:
            target = workdir / "sglang_delta_decoders.py"
            target.write_text(extract_new_file(text, DECODERS))
            spec = importlib.util.spec_from_file_location(DECODERS_MODULE, target)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    raise SlimeSourceError(f"no patch of patches/sglang adds {DECODERS}")


def _bytes(tensor) -> np.ndarray:
    import torch

    return tensor.contiguous().view(torch.uint8).numpy().reshape(-1)


class SlimeSource:
    """One slime checkout, ready to encode and apply cases. Use as a context manager: it
    holds a one-rank gloo process group and a scratch directory."""

    def __init__(self, src: str | Path) -> None:
        self.src = Path(src).resolve()
        self.encoder = load_encoder_module(self.src)
        disk_delta = sys.modules["slime.utils.disk_delta"]
        self.encodings = ["xor"] + (["sparse"] if hasattr(disk_delta, "sparse_encode") else [])

    @classmethod
    def or_exit(cls, src: str | Path) -> SlimeSource:
        """The source, or exit with one line naming the problem (a CLI's bad input)."""
        try:
            return cls(src)
        except SlimeSourceError as exc:
            raise SystemExit(f"--slime-src: {exc}") from None

    def __enter__(self) -> SlimeSource:
        import torch.distributed as dist
        from slime.utils import distributed_utils

        self.workdir = Path(tempfile.mkdtemp(prefix="slime-src-"))
        self.apply = load_apply_module(self.src, self.workdir)
        self._decoders_registered = False
        if "sparse" in self.encodings and importlib.util.find_spec("sglang") is None:
            sys.modules[DECODERS_MODULE] = load_sglang_decoders(self.workdir)
            self._decoders_registered = True
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{self.workdir / 'pg'}", rank=0, world_size=1)
        distributed_utils.init_gloo_group()
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist
        from slime.utils import distributed_utils

        distributed_utils.GLOO_GROUP = None
        if self._decoders_registered:
            sys.modules.pop(DECODERS_MODULE, None)
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _updater(self, encoding: str, case_dir: Path):
        args = Namespace(
            update_weight_disk_dir=str(case_dir / "shared"),
            update_weight_delta_encoding=encoding,
            update_weight_delta_checksum=CHECKSUM,
            custom_update_weight_post_write_path=None,
            hf_checkpoint=str(case_dir / "base"),
        )
        updater = self.encoder.UpdateWeightFromDiskDelta(
            args, [], None, model_name="bench", quantization_config=None
        )
        updater.connect_rollout_engines([], None)
        return updater

    def measure(self, base: dict, new: dict, repeats: int) -> dict[str, dict[str, Any]]:
        """Per encoding: payload bytes, file bytes, best encode time of slime's
        ``_encode_delta``, the engine apply time, and whether the apply is bit-exact."""
        import safetensors.torch

        out = {}
        for encoding in self.encodings:
            case_dir = Path(tempfile.mkdtemp(dir=self.workdir))
            (case_dir / "base").mkdir()
            safetensors.torch.save_file(base, str(case_dir / "base" / "model.safetensors"))
            updater = self._updater(encoding, case_dir)
            updater._iter_hf_tensors = lambda: iter(list(new.items()))
            times = []
            for _ in range(repeats):
                updater._snapshot = {name: _bytes(t).copy() for name, t in base.items()}
                updater.weight_version = 1
                t0 = time.perf_counter()
                updater._encode_delta()
                times.append(time.perf_counter() - t0)
            payload = sum(int(v.nbytes) for v in updater._delta.values())
            updater._write_delta_files()
            local = case_dir / "local"
            self.apply.pull(str(local), str(case_dir / "base"), str(case_dir / "shared"), 0)
            t0 = time.perf_counter()
            self.apply.pull(str(local), str(case_dir / "base"), str(case_dir / "shared"), 1)
            apply_s = time.perf_counter() - t0
            applied = safetensors.torch.load_file(str(local / "model.safetensors"))
            exact = all(np.array_equal(_bytes(applied[k]), _bytes(v)) for k, v in new.items())
            out[f"slime_{encoding}"] = {
                "bytes": payload,
                "file_bytes": int(updater.wire_bytes),
                "encode_s": min(times),
                "apply_s": apply_s,
                "bit_exact": exact,
            }
            shutil.rmtree(case_dir, ignore_errors=True)
        return out


def with_slime(run_case, source: SlimeSource):
    """Wrap ``weight_sync.run_case`` so every delta case also carries slime's own numbers."""

    def wrapped(name, base, new, codecs, repeats, anchor=False, **options):
        case = run_case(name, base, new, codecs, repeats, anchor=anchor, **options)
        if not anchor:
            case["slime_src"] = source.measure(base, new, repeats)
        return case

    return wrapped


def render(cases: list[dict[str, Any]], src: Path) -> str:
    """Markdown: slime's code beside ours, per delta case."""
    rows = []
    for c in cases:
        s = c.get("slime_src")
        if not s:
            continue
        ours = c["codecs"]["modal_rl"]
        xor = s["slime_xor"]
        row = [c["name"], f"{c['density']:.3%}", f"{ours['bytes']:,} / {ours['encode_s'] * 1e3:.0f}"]
        for key in ("slime_xor", "slime_sparse"):
            r = s.get(key)
            row.append(
                f"{r['bytes']:,} / {r['encode_s'] * 1e3:.0f} / {r['apply_s'] * 1e3:.0f}"
                + ("" if r["bit_exact"] else " NOT EXACT")
                if r
                else "-"
            )
        sparse = s.get("slime_sparse")
        row += [
            f"{ours['bytes'] / xor['bytes']:.3f}",
            f"{sparse['bytes'] / xor['bytes']:.3f}" if sparse else "-",
        ]
        rows.append(row)
    if not rows:
        return ""
    from benchmarks.report import markdown_table

    head = [
        "case",
        "density",
        "modal_rl bytes / enc ms",
        "slime xor",
        "slime sparse",
        "ours/xor",
        "sparse/xor",
    ]
    return (
        f"\n## slime's own code ({src})\n\n"
        "slime columns: payload bytes / `_encode_delta` ms (best) / engine `pull` ms "
        "(disk, mmap, checksum verified), all run from the checkout.\n\n" + markdown_table(head, rows) + "\n"
    )
