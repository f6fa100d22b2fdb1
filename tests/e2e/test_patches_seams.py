"""verl_modal on a verl that has our upstream fixes uses verl's seams instead of its run-time
shims; on the installed (unpatched) verl 0.9.1 it keeps the shims. The same probe runs in a
subprocess against both: the verl 0.9.1 sdist with ``patches/verl/`` applied (in a temp dir,
first on ``PYTHONPATH``), and the installed verl (so the test can fail).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from patches import check, series_path
from patches.series import load

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, os, sys
import verl
from omegaconf import OmegaConf
from verl_modal import pools, runner, upstream
from verl_modal.cpu import patches

os.environ.pop(pools.PLACEMENT_ENV, None)
os.environ[pools.WAIT_ENV] = "42"
seams = upstream.seams()
swapped = pools.install()
# Built where verl builds it: one of the five construction sites (a late-imported one).
from verl.experimental.separation.utils import create_resource_pool_manager
from verl.trainer.ppo.utils import Role
site_config = OmegaConf.create({"trainer": {"n_gpus_per_node": 1, "nnodes": 1}})
manager = create_resource_pool_manager(site_config, roles=[Role.Actor])
patches.install()
import vllm.v1.engine.async_llm  # the post-import hook decides whether to wrap pause_generation
config = OmegaConf.create(
    {"trainer": {"v1": {"trainer_mode": "separate_async"}}, "actor_rollout_ref": {"hybrid_engine": False}}
)
os.environ[pools.PLACEMENT_ENV] = '{"trainer_pool": [0]}'  # a placement plan needs our manager
swapped_with_plan = pools.install()
placed = create_resource_pool_manager(site_config, roles=[Role.Actor])
print(json.dumps({
    "swapped_with_plan": swapped_with_plan,
    "placed_ours": type(placed) is pools.manager_class(),
    "placed_wait_s": placed.wait_timeout_s,
    "verl": os.path.dirname(verl.__file__),
    "seams": seams,
    "swapped": swapped,
    "ours": type(manager) is pools.manager_class(),
    "wait_timeout_s": getattr(manager, "wait_timeout_s", None),
    "pause_wrapped": patches.installed()["vllm_pause_generation"],
    "pg_wrapped": patches.installed()["init_process_group"],
    "log_quieted": runner.quiet_separate_async_info_log(config),
}))
"""


def _probe(pythonpath: list[str]) -> dict:
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "none"}
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, str(ROOT), str(ROOT / "tests")])
    for key in (
        "VERL_RESOURCE_POOL_WAIT_TIMEOUT",
        "VERL_MODAL_POOL_PLACEMENT",
        "VERL_RESOURCE_POOL_MANAGER_CLASS",
    ):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def patched_verl(tmp_path_factory) -> Path:
    scratch = tmp_path_factory.mktemp("patched-verl")
    return check.apply_series(load(series_path("verl")), "sdist", scratch)


def test_patched_verl_uses_the_upstream_seams(patched_verl):
    seen = _probe([str(patched_verl)])
    assert seen["verl"] == str(patched_verl / "verl")
    assert seen["seams"] == dict.fromkeys(seen["seams"], True)
    # verl's seam (patch 0008) builds our subclass by name at every site: nothing is swapped
    assert seen["swapped"] == [] and seen["swapped_with_plan"] == []
    assert seen["ours"] and seen["wait_timeout_s"] == 42.0
    assert seen["pause_wrapped"] is False
    assert seen["pg_wrapped"] is False  # verl builds "cpu:gloo" itself (patch 0006)
    assert seen["log_quieted"] is False
    assert seen["placed_ours"] and seen["placed_wait_s"] == 42.0


def test_unpatched_verl_keeps_the_shims():
    seen = _probe([])
    assert seen["seams"] == dict.fromkeys(seen["seams"], False)
    assert "verl.trainer.ppo.v1.trainer_base" in seen["swapped"]
    assert seen["ours"] and seen["wait_timeout_s"] == 42.0  # swapped in when separation.utils loads
    assert seen["placed_ours"] and seen["placed_wait_s"] == 42.0
    assert seen["pause_wrapped"] is True
    assert seen["pg_wrapped"] is True
    assert seen["log_quieted"] is True
