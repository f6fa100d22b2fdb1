"""slime's rollout actor as our ``RolloutManager`` subclass, through slime's own seam.

On a slime checkout with ``patches/slime`` applied (``--rollout-manager-path``, patch 0004),
slime's ``create_rollout_manager`` builds ``slime_modal.rollout_manager.ModalRolloutManager``
in a real Ray actor on 127.0.0.1. That actor starts the engines (the keyed SGLang stand-in
``_sglang_auth_server`` under the real keyed launcher, in a real local pool under the real
supervisor), puts its key forwarder before them, and runs slime's own constructor on them:
slime's ``apply_external_engine_info_to_args`` reads each one's ``/server_info`` through the
forwarder, and slime makes one ``SGLangEngine`` actor per forwarder port, registered with the
router. Then an engine is killed: it is replaced, caught up through slime's weight path, and
routed to again, and slime's own engine actor for that slot reaches the replacement.

Two boundaries, both of this CPU host, nothing of slime replaced (``tests/_slime_cpu_boundary``,
put on the Ray workers' ``PYTHONPATH``): the ``sglang`` package, which slime's rollout modules
import at module level and whose own modules need packages this environment lacks (torchvision first)
(only the names slime imports, SGLang's values); and the accelerator, which slime's
``SGLangEngine.init`` asks for even for an external engine (a ``cpu`` backend registered through
slime's own ``register_accelerator``, by that directory's ``sitecustomize``). slime's router
(``sglang_router``, a separate binary package) is not started: slime takes a router address it
is given (``--sglang-router-ip``), here a recorder of the registrations slime's engine actors
make. The fast tests: the seam read from slime's source, the manager's flags and config, and
the launcher's dry-run plan with and without the seam.

Needs a slime git checkout (``$SLIME_PATH``, else the fetched mirror): skipped without one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import tomllib
from argparse import Namespace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from modal_rl.run_key import new_run_key
from slime_modal import manager_seam
from slime_modal.engines import EnginesRequest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
BOUNDARY = TESTS / "_slime_cpu_boundary"
SERIES = ROOT / "patches" / "slime" / "series.toml"
MIRROR = Path("/work/.mirror/THUDM+slime/repo")
KEYED_STAND_IN = (
    sys.executable,
    "-m",
    "modal_rl.engines.keyed_launch",
    "--key-flag=--api-key",
    "--key-flag=--admin-api-key",
    "_sglang_auth_server",
)


def _git(cwd: Path, *args: str) -> None:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost"}
    env |= {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@localhost"}
    proc = subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, f"git {args[0]}: {proc.stderr.strip()}"


def checkout(tmp: Path, patched: bool) -> Path:
    """slime at the series' base, with the series applied when ``patched``."""
    source = next(
        (Path(p) for p in (os.environ.get("SLIME_PATH"), str(MIRROR)) if p and Path(p).is_dir()), None
    )
    if source is None:
        pytest.skip("no slime checkout: set SLIME_PATH to a slime git checkout")
    series = tomllib.loads(SERIES.read_text())
    tree = tmp / ("patched" if patched else "base")
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(source), str(tree)], check=True)
    _git(tree, "checkout", "-q", series["base"]["commit"])
    for entry in series["patch"] if patched else []:
        _git(tree, "am", "-q", str(SERIES.parent / entry["file"]))
    return tree


class Router(ThreadingHTTPServer):
    """Where slime's engine actors register (``POST /workers``), as slime's router takes them."""

    def __init__(self):
        self.workers: list[dict] = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(handler):  # noqa: N805
                body = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
                if handler.path == "/workers":
                    self.workers.append(json.loads(body))
                handler.send_response(200)
                handler.send_header("Content-Type", "application/json")
                handler.end_headers()
                handler.wfile.write(b"{}")

            def log_message(handler, *args):  # noqa: N805
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def slime_args(tmp: Path, router: Router) -> Namespace:
    """What slime's parser leaves on ``args`` for this run (the fields its rollout actor reads)."""
    return Namespace(
        rollout_manager_path=manager_seam.MANAGER_PATH,
        hf_checkpoint="/models/tiny",
        rollout_external_engine_addrs=None,
        rollout_external=False,
        rollout_num_gpus=0,
        rollout_num_gpus_per_engine=1,
        num_gpus_per_node=1,
        sglang_pp_size=1,
        sglang_dp_size=1,
        sglang_ep_size=1,
        sglang_router_ip="127.0.0.1",
        sglang_router_port=router.server_address[1],
        sglang_server_concurrency=8,
        use_distributed_post=False,
        seed=1234,
        offload_rollout=False,
        fp16=False,
        use_rollout_routing_replay=False,
        debug_train_only=False,
        debug_rollout_only=False,
        data_source_path="tests._slime_manager_data.PromptList",
        rollout_function_path="slime.rollout.sglang_rollout.generate_rollout",
        eval_function_path="slime.rollout.sglang_rollout.generate_rollout",
        custom_reward_post_process_path=None,
        custom_convert_samples_to_train_data_path=None,
        use_wandb=False,
        use_tensorboard=False,
        use_fault_tolerance=True,  # the launcher adds --use-fault-tolerance (manager_seam)
        ci_test=False,
        rollout_global_dataset=True,
        rollout_batch_size=2,
        num_rollout=None,
        num_epoch=1,
        check_weight_update_equal=False,
    )


def publish(disk_dir: Path, version: int) -> None:
    vdir = disk_dir / f"weight_v{version:06d}"
    vdir.mkdir(parents=True)
    shard = "model-00000-of-00001.safetensors"
    (vdir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    (vdir / shard).write_bytes(b"delta")


def requests_seen(state: Path, url: str) -> list[dict]:
    path = state / f"{url.rsplit(':', 1)[1]}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def ended(pid: int, timeout_s: float = 10.0) -> None:
    """Until ``pid`` is gone or a zombie (its parent, the pool, sees it exited)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except (FileNotFoundError, IndexError):
            return
        time.sleep(0.02)
    raise AssertionError(f"engine process {pid} did not end")


@pytest.fixture(scope="module")
def trees(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("slime")
    return {"base": checkout(tmp, patched=False), "patched": checkout(tmp, patched=True)}


def test_the_seam_is_read_from_slimes_source(trees, tmp_path):
    assert manager_seam.seam_present(str(trees["patched"]))
    assert not manager_seam.seam_present(str(trees["base"]))
    assert not manager_seam.seam_present(str(tmp_path / "none"))
    request = EnginesRequest(2, "H100")
    assert manager_seam.uses_manager(str(trees["patched"]), "local", request)
    assert not manager_seam.uses_manager(str(trees["patched"]), "local", None)
    assert not manager_seam.uses_manager(str(trees["patched"]), "modal", request)
    assert not manager_seam.uses_manager(str(trees["base"]), "local", request)


def test_the_manager_flags_and_its_engine_config():
    line = ["--hf-checkpoint", "/m", "--update-weight-transport", "disk", "--update-weight-disk-dir", "/d"]
    assert manager_seam.manager_argv(line) == [
        *line,
        "--rollout-manager-path",
        manager_seam.MANAGER_PATH,
        "--rollout-num-gpus",
        "0",
        "--use-fault-tolerance",
    ]
    kept = [*line, "--rollout-num-gpus", "0", "--use-fault-tolerance"]  # the user's own: not repeated
    assert manager_seam.manager_argv(kept) == [*kept, "--rollout-manager-path", manager_seam.MANAGER_PATH]
    for bad in (["--rollout-num-gpus", "4"], ["--rollout-manager-path", "x.Y"]):
        with pytest.raises(ValueError, match=bad[0]):
            manager_seam.manager_argv([*line, *bad])
    from modal_rl.engines.pool import EngineSpec
    from slime_modal.engines import engine_spec

    config = json.loads(manager_seam.manager_env(EnginesRequest(2, "H100"), line)[manager_seam.CONFIG_ENV])
    assert EngineSpec.from_dict(config["spec"]) == engine_spec(EnginesRequest(2, "H100"), line)
    assert config["weights"] == {"transport": "disk", "disk_dir": "/d", "local_checkpoint_dir": None}
    assert config["health"] == {}  # replaced when lost
    nccl = json.loads(manager_seam.manager_env(EnginesRequest(1, "H100"), line[:2])[manager_seam.CONFIG_ENV])
    assert nccl["health"] == {"max_replacements": 0}  # NCCL weights: reported, never replaced


def test_the_launcher_names_our_manager_only_where_slime_has_the_seam(trees, tmp_path):
    from tests._launcher import run_module

    (tmp_path / "model").mkdir()
    line = [
        "--hf-checkpoint",
        str(tmp_path / "model"),
        "--actor-num-nodes",
        "1",
        "--actor-num-gpus-per-node",
        "1",
    ]
    line += ["--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path / "d")]
    plans = {}
    for name, tree in trees.items():
        out, _ = run_module(
            "slime_modal",
            "--backend",
            "local",
            "--slime-path",
            str(tree),
            "--rollout-engines",
            "modal:2",
            "--dry-run",
            "--json",
            "--",
            *line,
        )
        assert out.returncode == 0, out.stderr
        plans[name] = json.loads(out.stdout)
    seam, base = plans["patched"], plans["base"]
    assert seam["rollout_manager"]["used"] and not base["rollout_manager"]["used"]
    added = [
        "--rollout-manager-path",
        manager_seam.MANAGER_PATH,
        "--rollout-num-gpus",
        "0",
        "--use-fault-tolerance",
    ]
    assert seam["slime"]["argv"] == [*line, *added] and seam["slime"]["added_argv"] == added
    assert base["slime"]["argv"] == line
    assert seam["rollout_engines"]["owner"] == manager_seam.MANAGER_PATH
    assert seam["rollout_engines"]["job_command"] is None and base["rollout_engines"]["job_command"]
    assert "slime_modal.engine_job" not in json.dumps(seam["entrypoint"])
    config = json.loads(seam["runtime_env"]["env_vars"][manager_seam.CONFIG_ENV])
    assert config["backend"] == "local" and config["spec"]["count"] == 2
    assert manager_seam.CONFIG_ENV not in base["runtime_env"]["env_vars"]


@pytest.fixture
def patched_slime_on_path(trees):
    tree = trees["patched"]
    saved = list(sys.path)
    sys.path[:0] = [str(tree), str(BOUNDARY)]
    try:
        yield tree
    finally:
        sys.path[:] = saved
        for name in [n for n in sys.modules if n.split(".")[0] in ("slime", "sglang")]:
            del sys.modules[name]
        sys.modules.pop("slime_modal.rollout_manager", None)


@pytest.mark.slow
def test_slime_runs_our_manager_which_replaces_a_killed_engine(
    tmp_path, tmp_path_factory, patched_slime_on_path
):
    from tests._local_ray import loopback_ray

    key = new_run_key()
    state, disk = tmp_path / "state", tmp_path / "published"
    state.mkdir()
    publish(disk, 1)
    publish(disk, 2)  # slime's newest: what the replacement must hold
    argv = [
        "--hf-checkpoint",
        "/models/tiny",
        "--update-weight-transport",
        "disk",
        "--update-weight-mode",
        "delta",
        "--update-weight-disk-dir",
        str(disk),
        "--update-weight-local-checkpoint-dir",
        str(tmp_path / "local-ckpt"),
        "--sglang-state",
        str(state),
    ]
    env = manager_seam.manager_env(
        EnginesRequest(2, "H100"),
        argv,
        health={"interval_s": 0.3, "probe_timeout_s": 5.0, "failures": 2},
        pool_kwargs={"log_dir": str(tmp_path / "logs")},
        server=KEYED_STAND_IN,
    )
    path = os.pathsep.join([str(ROOT), str(patched_slime_on_path), str(BOUNDARY), str(TESTS)])
    os.environ["MODAL_RL_RUN_KEY"] = key  # the launcher's (ensure_run_key); the pool needs it here
    router = Router()
    try:
        with loopback_ray(tmp_path_factory, 4, {"PYTHONPATH": path, "MODAL_RL_RUN_KEY": key, **env}) as ray:
            from slime.ray.placement_group import create_rollout_manager

            args = slime_args(tmp_path, router)
            manager, per_epoch = create_rollout_manager(args, None)
            try:
                report = ray.get(manager.engine_report.remote())
                forwarded = report["addresses"]
                assert sorted(w["url"] for w in router.workers) == sorted(forwarded)  # slime's engine actors
                assert per_epoch == 1 and args.num_rollout == 1  # slime's follow-up calls
                engines, lock, num_new, *_ = ray.get(manager.get_updatable_engines_and_lock.remote())
                assert len(engines) == 2
                old = report["engines"][0]["url"]
                assert "/server_info" in [r["path"] for r in requests_seen(state, old)]  # slime read it

                os.killpg(report["pids"][0], signal.SIGKILL)
                ended(report["pids"][0])
                ray.get(manager.recover_updatable_engines.remote())  # slime's call before an update
                report = ray.get(manager.engine_report.remote())
                new = report["engines"][0]["url"]
                assert new != old and report["addresses"] == forwarded
                kinds = [e["kind"] for e in report["events"] if e.get("index") == 0]
                assert kinds[-4:] == ["lost", "replaced", "caught_up", "serving"], kinds

                # slime's own engine actor for slot 0 (its update path) now reaches the replacement.
                ray.get(engines[0].flush_cache.remote())
                paths = [r["path"] for r in requests_seen(state, new)]
                pull, reload = paths.index("/pull_weights"), paths.index("/update_weights_from_disk")
                assert pull < reload < paths.index("/flush_cache"), paths
                seen = requests_seen(state, new)
                assert json.loads(seen[pull]["body"])["target_version"] == 2
                # The other engine kept its process and never saw a catch-up.
                assert report["engines"][1]["generation"] == 0
                assert "/pull_weights" not in [
                    r["path"] for r in requests_seen(state, report["engines"][1]["url"])
                ]
            finally:
                ray.get(manager.dispose.remote())
                ray.kill(manager)
            assert report["pids"][1] is not None
            with pytest.raises(ProcessLookupError):
                os.kill(report["pids"][1], 0)  # dispose stopped the engines
    finally:
        os.environ.pop("MODAL_RL_RUN_KEY", None)
        router.shutdown()
        router.server_close()
