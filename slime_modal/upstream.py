"""The ``patches/slime`` series in the Modal image, until upstream merges it.

With ``--backend modal``, the image slime runs in (the trainer cluster's and the Modal rollout
engines') gets, on top of the registry image:

1. the series' patch files, copied to :data:`REMOTE_DIR`;
2. ``git am -3`` of the series, in order, onto the image's slime checkout (``--slime-path``);
3. the engine side (``python3 -c`` of :data:`_REFRESH`, base64-encoded to stay one line):
   slime's SGLang patch (now patched) adds ``sglang/srt/weight_sync/
   local_checkpoint.py`` as a whole new file, already installed in the image's SGLang from
   the unpatched patch; it is rewritten from the patched one (only that file: the series
   changes nothing else in the SGLang patch). Next to it goes ``delta_decoders.py``, the
   whole new file of the ``patches/sglang`` series (copied to :data:`SGLANG_REMOTE_DIR`):
   SGLang's own decoders, which the patched apply takes ``sparse`` from.

A build step that fails (the image's slime moved past the base and a patch no longer applies,
or its SGLang lacks slime's pull_weights patch) fails the image build with git's or the
script's message; ``--no-slime-patches`` runs the registry image as it is. The dry-run plan
lists the patches and the exact build commands (:func:`plan`).

The steps reach both images as the ``extra_steps`` parameter of ``modal_rl.cluster``'s image
builders (:func:`image_steps`); nothing of theirs is replaced.
"""

from __future__ import annotations

import argparse
import base64
import functools
import inspect
import re
import shlex
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from modal_rl import package_data

SERIES_DIR = package_data.series_dir("slime")  # packaged with the wheel, else the checkout's patches/slime
REMOTE_DIR = "/opt/modal_rl/patches/slime"
SGLANG_SERIES_DIR = package_data.series_dir("sglang")
SGLANG_REMOTE_DIR = "/opt/modal_rl/patches/sglang"
SGLANG_PATCH = "docker/patch/latest/sglang-pull_weights.patch"
ENGINE_APPLY = "python/sglang/srt/weight_sync/local_checkpoint.py"
DECODERS = "python/sglang/srt/weight_sync/delta_decoders.py"
FLAG = "--no-slime-patches"
ENCODING_FLAG = "--update-weight-delta-encoding"  # 'sparse': slime's 0002 + SGLang's decoders


class SeriesMissingError(RuntimeError):
    """The series files are neither packaged nor in a checkout next to this package."""


def add_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        FLAG,
        action="store_true",
        help="--backend modal: run the image's slime as it is (default: apply patches/slime to it)",
    )


def series(series_dir: Path = SERIES_DIR) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(base, patches)`` of ``series.toml``; each patch is its table (file, title, ...)."""
    path = series_dir / "series.toml"
    if not path.is_file():
        raise SeriesMissingError(
            f"{path} not found: reinstall modal-rl from a wheel or a checkout (both carry the series), or pass {FLAG}"
        )
    data = tomllib.loads(path.read_text())
    return data["base"], list(data["patch"])


def extract_new_file(patch_text: str, path: str) -> str:
    """The whole file ``path`` that a patch adds (one ``@@ -0,0 +1,N @@`` hunk). Self-contained
    (it runs inside the image build as ``python3 -c``): stdlib only, no other names."""
    start = patch_text.index(f"+++ b/{path}\n")
    lines = patch_text[start:].splitlines(keepends=True)
    header = re.match(r"@@ -0,0 \+1,(\d+) @@", lines[1])
    if header is None or not all(line.startswith("+") for line in lines[2 : 2 + int(header.group(1))]):
        raise ValueError(f"the {path} hunk is not one whole new file")
    return "".join(line[1:] for line in lines[2 : 2 + int(header.group(1))])


def extract_engine_apply(patch_text: str) -> str:
    """The whole new ``local_checkpoint.py`` that slime's SGLang patch adds."""
    return extract_new_file(patch_text, ENGINE_APPLY)


_REFRESH = """
import importlib.util, os, re, sys
{source}
spec = importlib.util.find_spec("sglang")
target = os.path.join(spec.submodule_search_locations[0], "srt", "weight_sync", "local_checkpoint.py")
if not os.path.isfile(target):
    sys.exit(f"{{target}} missing: the image's SGLang lacks slime's pull_weights patch")
with open(os.path.join(sys.argv[1], {patch!r})) as f:
    text = extract_new_file(f.read(), {apply!r})
with open(target, "w") as f:
    f.write(text)
print(f"refreshed {{target}} from the patched slime SGLang patch")
for name in sorted(os.listdir(sys.argv[2])):
    with open(os.path.join(sys.argv[2], name)) as f:
        text = f.read()
    if "+++ b/" + {decoders!r} + "\\n" in text:
        decoders = os.path.join(os.path.dirname(target), os.path.basename({decoders!r}))
        with open(decoders, "w") as f:
            f.write(extract_new_file(text, {decoders!r}))
        print(f"wrote {{decoders}} from {{name}}")
"""


def build_commands(
    slime_path: str,
    patch_files: list[str],
    remote_dir: str = REMOTE_DIR,
    sglang_dir: str = SGLANG_REMOTE_DIR,
) -> list[str]:
    """The image's shell build steps after the patch files are at ``remote_dir`` (slime's)
    and ``sglang_dir`` (the ``patches/sglang`` series')."""
    paths = " ".join(shlex.quote(f"{remote_dir}/{name}") for name in patch_files)
    identity = "-c user.name=modal-rl -c user.email=modal-rl@localhost"
    refresh = _REFRESH.format(
        source=inspect.getsource(extract_new_file), patch=SGLANG_PATCH, apply=ENGINE_APPLY, decoders=DECODERS
    )
    # One line: a Dockerfile RUN instruction ends at a newline.
    script = base64.b64encode(refresh.encode()).decode()
    return [
        f"cd {shlex.quote(slime_path)} && git {identity} am -3 --keep-non-patch {paths}",
        f"python3 -c 'import base64; exec(base64.b64decode(\"{script}\"))' "
        f"{shlex.quote(slime_path)} {shlex.quote(sglang_dir)}",
    ]


def extend_image(image, slime_path: str, series_dir: Path = SERIES_DIR):
    """``image`` (a ``modal.Image``) with the series applied (see the module doc)."""
    _, patches = series(series_dir)
    files = [p["file"] for p in patches]
    image = image.add_local_dir(series_dir, REMOTE_DIR, copy=True, ignore=lambda p: p.suffix != ".patch")
    image = image.add_local_dir(
        SGLANG_SERIES_DIR, SGLANG_REMOTE_DIR, copy=True, ignore=lambda p: p.suffix != ".patch"
    )
    return image.run_commands(*build_commands(slime_path, files))


def problems(
    args: argparse.Namespace, slime_argv: list[str] = (), series_dir: Path = SERIES_DIR
) -> list[str]:
    """One line per reason the series cannot go into the image, or is needed and opted out of."""
    if not enabled(args):
        from slime_modal.preflight import SlimeArgs

        if args.backend == "modal" and SlimeArgs(list(slime_argv)).get(ENCODING_FLAG) == "sparse":
            return [f"{ENCODING_FLAG} sparse needs the patches/slime series in the image: drop {FLAG}"]
        return []
    try:
        series(series_dir)
    except (SeriesMissingError, KeyError, tomllib.TOMLDecodeError) as exc:
        return [f"{exc}" if isinstance(exc, SeriesMissingError) else f"{series_dir}/series.toml: {exc!r}"]
    return []


def enabled(args: argparse.Namespace) -> bool:
    return args.backend == "modal" and not getattr(args, "no_slime_patches", False)


def plan(args: argparse.Namespace, series_dir: Path = SERIES_DIR) -> dict[str, Any]:
    """The dry-run plan's ``slime_patches`` section."""
    if args.backend != "modal":
        return {"applied": False, "why": "--backend local runs the slime checkout at --slime-path as it is"}
    if not enabled(args):
        return {"applied": False, "why": f"{FLAG}"}
    base, patches = series(series_dir)
    return {
        "applied": True,
        "base": base["name"],
        "slime_path": args.slime_path,
        "patches": [{"file": p["file"], "title": p["title"]} for p in patches],
        "image_steps": [
            f"copy {series_dir} -> {REMOTE_DIR}",
            f"copy {SGLANG_SERIES_DIR} -> {SGLANG_REMOTE_DIR}",
        ]
        + build_commands(args.slime_path, [p["file"] for p in patches]),
    }


def image_steps(args: argparse.Namespace, series_dir: Path = SERIES_DIR) -> list[Callable[[Any], Any]]:
    """The extra build steps of the cluster's and the Modal engines' images: the series (when
    :func:`enabled`), else none. Passed to ``modal_rl.cluster``'s image builders as their
    ``extra_steps`` (``run_job(image_steps=...)``, ``ModalEnginePool(image_steps=...)``), which
    apply them before mounting this project's sources."""
    if not enabled(args):
        return []
    series(series_dir)  # fail before anything starts when the files are missing
    return [functools.partial(extend_image, slime_path=args.slime_path, series_dir=series_dir)]
