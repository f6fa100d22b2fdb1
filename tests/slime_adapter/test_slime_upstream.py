"""``slime_modal.upstream``: the ``patches/slime`` series in the Modal image, offline.

The dry-run plan comes from the real launcher in a subprocess; the images are built (not
deployed) in process and read back layer by layer; the image's build commands run for real
against a clone of slime and a stand-in for the image's SGLang package. No Modal server.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tomllib
from pathlib import Path

import pytest

from slime_modal import launch as L
from slime_modal import upstream
from tests._launcher import run_module
from tests._slime_lines import glm47_delta

SERIES = upstream.SERIES_DIR / "series.toml"
PATCH_FILES = [p["file"] for p in tomllib.loads(SERIES.read_text())["patch"]]
MIRROR = Path("/work/.mirror/THUDM+slime/repo")
VOLUMES = ["--volume", "models:/root/models", "--volume", "datasets:/root/datasets"]
VOLUMES += ["--volume", "glm-delta:/shared/fs"]


def dry_plan(*argv: str) -> dict:
    out, _ = run_module("slime_modal", *argv, timeout=90)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_modal_dry_run_plan_lists_the_series_applied_to_the_image():
    plan = dry_plan(
        "--backend",
        "modal",
        "--gpu",
        "H100:8",
        "--nodes",
        "4",
        *VOLUMES,
        "--dry-run",
        "--json",
        "--",
        *glm47_delta(),
    )
    section = plan["slime_patches"]
    assert section["applied"] is True and section["base"] == "slime 624b824a8"
    assert [p["file"] for p in section["patches"]] == PATCH_FILES
    assert section["slime_path"] == L.SLIME_PATH
    steps = section["image_steps"]
    assert steps[0].endswith(f"-> {upstream.REMOTE_DIR}")
    assert steps[1].endswith(f"-> {upstream.SGLANG_REMOTE_DIR}")
    assert steps[2].startswith(f"cd {L.SLIME_PATH} && git ") and " am -3 " in steps[2]
    assert all(f"{upstream.REMOTE_DIR}/{name}" in steps[2] for name in PATCH_FILES)
    assert steps[3].startswith("python3 -c ") and steps[3].endswith(upstream.SGLANG_REMOTE_DIR)


def test_plan_says_when_the_series_is_not_applied():
    plan = dry_plan(
        "--backend",
        "modal",
        "--gpu",
        "H100:8",
        "--nodes",
        "4",
        "--no-slime-patches",
        *VOLUMES,
        "--dry-run",
        "--json",
        "--",
        *glm47_delta(),
    )
    assert plan["slime_patches"] == {"applied": False, "why": "--no-slime-patches"}
    local = upstream.plan(_args(backend="local"))
    assert local["applied"] is False and "--backend local" in local["why"]


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(
        **{"backend": "modal", "slime_path": L.SLIME_PATH, "no_slime_patches": False, **kw}
    )


def _inner(obj):
    return next((v for k, v in vars(obj).items() if k.startswith("_sync_original")), obj)


def image_layers(image) -> list[tuple[str, object]]:
    """``[("build", dockerfile commands) | ("mount", mount)]`` from the registry image up."""
    layers, current = [], image
    while current is not None:
        load = _inner(current)._load
        cells = dict(zip(load.__code__.co_freevars, [c.cell_contents for c in load.__closure__], strict=True))
        if "mount" in cells:
            layers.append(("mount", cells["mount"]))
            current = cells["base_image"]
            continue
        dockerfile = cells.get("dockerfile_function")
        layers.append(("build", dockerfile("2024.10").commands if dockerfile else None))
        current = next(iter((cells.get("base_images") or {}).values()), None)
    return layers[::-1]


def _assert_series_then_sources(layers, first: str):
    builds = [cmds for kind, cmds in layers if kind == "build"]
    assert builds[0][0] == f"FROM {first}"
    *copies, run = builds[-3:]
    assert copies == [["FROM base", "COPY . /"]] * 2  # the slime and SGLang series files
    assert run[0] == "FROM base" and len(run) == 3 and all("\n" not in c for c in run)
    assert " am -3 " in run[1] and all(f"{upstream.REMOTE_DIR}/{name}" in run[1] for name in PATCH_FILES)
    assert run[2].startswith("RUN python3 -c 'import base64; exec(")
    assert layers[-1][0] == "mount"  # the project's sources stay the last layer
    assert all(kind == "build" for kind, _ in layers[:-1])


def test_cluster_and_engine_images_carry_the_series_as_extra_steps():
    """The series reaches both images through the builders' ``extra_steps`` parameter: the
    builders themselves are never replaced, and without the steps an image has no series."""
    from modal_rl.cluster import backend_modal
    from modal_rl.cluster.spec import ClusterSpec
    from modal_rl.engines import pool_modal as engines_modal
    from modal_rl.engines.pool import EngineSpec
    from modal_rl.engines.pool_modal import ModalEnginePool

    cluster = ClusterSpec(nodes=2, gpu="H100:8", image=L.SLIME_IMAGE)
    engine = EngineSpec(
        command=["python3", "-m", "sglang.launch_server", "--port", "{port}"], image=L.SLIME_IMAGE
    )
    originals = backend_modal.build_image, engines_modal.build_image
    steps = upstream.image_steps(_args())
    assert len(steps) == 1
    _assert_series_then_sources(image_layers(backend_modal.build_image(cluster, steps)), L.SLIME_IMAGE)
    _assert_series_then_sources(image_layers(engines_modal.build_image(engine, steps)), L.SLIME_IMAGE)
    # The objects the launch builds with: the cluster backend and the Modal engine pool.
    backend = backend_modal.ModalBackend(image_steps=steps)
    backend.build_function(cluster, key="k" * 32)
    _assert_series_then_sources(image_layers(backend.last_image), L.SLIME_IMAGE)
    assert ModalEnginePool(engine, image_steps=steps).image_steps == tuple(steps)
    assert (backend_modal.build_image, engines_modal.build_image) == originals
    plain = "\n".join(str(c) for _, c in image_layers(backend_modal.build_image(cluster)))
    assert " am -3 " not in plain
    assert upstream.image_steps(_args(no_slime_patches=True)) == []


def test_upstream_replaces_no_module_attribute():
    """No ``module.name = ...`` assignment (the old ``build_image`` swap) in slime_modal/upstream.py."""
    import ast

    tree = ast.parse(Path(upstream.__file__).read_text())
    swaps = [
        ast.unparse(target)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Attribute)
    ]
    assert swaps == [], swaps


def test_missing_series_is_one_line_not_a_traceback(tmp_path):
    assert upstream.problems(_args(), series_dir=tmp_path) == [
        f"{tmp_path / 'series.toml'} not found: reinstall modal-rl from a wheel or a checkout "
        "(both carry the series), or pass --no-slime-patches"
    ]
    assert upstream.problems(_args(no_slime_patches=True), series_dir=tmp_path) == []


def test_sparse_encoding_without_the_series_is_refused_before_launch():
    line = [*glm47_delta(), "--update-weight-delta-encoding", "sparse"]
    flags = ["--backend", "modal", "--gpu", "H100:8", "--nodes", "4", *VOLUMES, "--dry-run", "--json"]
    out, _ = run_module("slime_modal", *flags, "--no-slime-patches", "--", *line, timeout=90)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "slime_modal: --update-weight-delta-encoding sparse needs the patches/slime series in the image: "
        "drop --no-slime-patches"
    ]
    assert dry_plan(*flags, "--", *line)["slime_patches"]["applied"] is True


@pytest.fixture
def base_checkout(tmp_path):
    source = os.environ.get("SLIME_PATH") or (str(MIRROR) if MIRROR.is_dir() else None)
    if source is None:
        pytest.skip("no slime checkout: set SLIME_PATH to a slime git checkout")
    tree = tmp_path / "slime"
    subprocess.run(["git", "clone", "-q", "--no-checkout", source, str(tree)], check=True)
    subprocess.run(["git", "-C", str(tree), "checkout", "-q", "624b824a8"], check=True)
    return tree


def test_image_build_commands_apply_the_series_and_refresh_sglang(tmp_path, base_checkout):
    """The exact commands the image runs, against a slime clone and an SGLang stand-in that
    holds the engine apply from the unpatched SGLang patch (what slime's image installs): the
    apply is rewritten from the patched one and SGLang's delta decoders are written beside it."""
    patch = (base_checkout / upstream.SGLANG_PATCH).read_text()
    installed = tmp_path / "site" / "sglang" / "srt" / "weight_sync" / "local_checkpoint.py"
    installed.parent.mkdir(parents=True)
    (tmp_path / "site" / "sglang" / "__init__.py").write_text("")
    installed.write_text(upstream.extract_engine_apply(patch))
    assert "_sglang_decoder" not in installed.read_text()

    commands = upstream.build_commands(
        str(base_checkout),
        PATCH_FILES,
        remote_dir=str(upstream.SERIES_DIR),
        sglang_dir=str(upstream.SGLANG_SERIES_DIR),
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    for command in commands:
        proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr
    titles = [p["title"] for p in tomllib.loads(SERIES.read_text())["patch"]]
    log = subprocess.run(
        ["git", "-C", str(base_checkout), "log", "--format=%s", f"-{len(titles) + 1}"],
        capture_output=True,
        text=True,
    )
    assert log.stdout.splitlines()[: len(titles)] == titles[::-1]
    refreshed = installed.read_text()
    assert refreshed == upstream.extract_engine_apply((base_checkout / upstream.SGLANG_PATCH).read_text())
    assert "_invalidate_applied_version" in refreshed and "_sglang_decoder" in refreshed
    (sglang_patch,) = upstream.SGLANG_SERIES_DIR.glob("*.patch")
    decoders = (installed.parent / "delta_decoders.py").read_text()
    assert decoders == upstream.extract_new_file(sglang_patch.read_text(), upstream.DECODERS)
    assert "def get_decoder(" in decoders


def test_refresh_fails_loud_without_slimes_sglang_patch(tmp_path, base_checkout):
    (tmp_path / "site" / "sglang").mkdir(parents=True)
    (tmp_path / "site" / "sglang" / "__init__.py").write_text("")
    refresh = upstream.build_commands(str(base_checkout), PATCH_FILES)[1]
    proc = subprocess.run(
        ["bash", "-c", refresh],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
    )
    assert proc.returncode != 0
    assert "lacks slime's pull_weights patch" in proc.stderr
