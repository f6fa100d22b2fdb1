"""slime preflight: bad slime command lines stop before anything starts, in seconds.

The end-to-end cases run the real launcher in a subprocess (``--backend local`` would
otherwise bring up Ray; a pass would show as a Ray bring-up, a failure as exit 2 with one
line per problem) and time it. The rules themselves are tested on ``preflight.check``
against what slime's ``arguments.py`` / ``placement_group.py`` do.
"""

from __future__ import annotations

import pytest

from slime_modal import preflight as pf
from tests._slime_lines import glm47_delta, qwen3_4b
from tests.slime_adapter.test_slime_launch import launcher


def _probe(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    return str(script)


def _assert_refused(out, seconds, *needles):
    assert out.returncode == 2, out.stderr
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, out.stderr
    for needle in needles:
        assert needle in lines[0]
    assert out.stdout == ""
    assert seconds < 10


def test_too_few_gpus_exits_2_in_seconds():
    out, seconds = launcher(
        "--backend",
        "modal",
        "--nodes",
        "2",
        "--gpu",
        "H100:8",
        "--volume",
        "m:/root/models",
        "--volume",
        "d:/root/datasets",
        "--volume",
        "w:/shared/fs",
        "--",
        *glm47_delta(),
    )
    _assert_refused(out, seconds, "asks for 32 GPUs (actor 2 x 8 + rollout 16)", "cluster has 16")


def test_delta_with_colocate_exits_2_in_seconds(tmp_path):
    line = [
        *qwen3_4b(root=str(tmp_path)),
        "--update-weight-mode",
        "delta",
        "--update-weight-transport",
        "disk",
    ]
    line += ["--update-weight-disk-dir", str(tmp_path / "w"), "--update-weight-local-checkpoint-dir", "/l"]
    for name in ("Qwen3-4B", "Qwen3-4B_torch_dist", "dapo-math-17k/dapo-math-17k.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    out, seconds = launcher(
        "--backend", "local", "--nodes", "1", "--gpu", "H100:8", "--entry", _probe(tmp_path), "--", *line
    )
    _assert_refused(out, seconds, "--update-weight-mode delta does not work with --colocate")


def test_missing_checkpoint_path_exits_2_in_seconds(tmp_path):
    out, seconds = launcher(
        "--backend",
        "local",
        "--gpu",
        "H100:8",
        "--entry",
        _probe(tmp_path),
        "--",
        "--actor-num-gpus-per-node",
        "4",
        "--rollout-num-gpus",
        "4",
        "--hf-checkpoint",
        str(tmp_path / "no-such-model"),
    )
    _assert_refused(out, seconds, f"--hf-checkpoint {tmp_path}/no-such-model: no such file or directory")


def test_unchanged_root_paths_are_refused_on_modal_with_the_fix():
    out, seconds = launcher("--backend", "modal", "--gpu", "H100:8", "--", *qwen3_4b())
    assert out.returncode == 2 and seconds < 10
    lines = out.stderr.splitlines()
    flags = [x.split()[1] for x in lines]
    assert flags == [
        "--hf-checkpoint",
        "--ref-load",
        "--prompt-data",
        "--load",
        "--save",
        "--eval-prompt-data",
    ]
    assert all("is not under any of the mounted Volumes" in x for x in lines)
    # each says which Volume to add (the default HF-cache Volume is not where they belong)
    assert all("add --volume NAME:/root" in x for x in lines), lines


def _check(argv, gpus=16, backend="modal", mounts=("/v",), external=False):
    return pf.check(
        argv,
        backend=backend,
        cluster_gpus=gpus,
        mounts=list(mounts),
        image_roots=["/root/slime"],
        external_engines=external,
    )


@pytest.mark.parametrize(
    ("argv", "gpus"),
    [
        (["--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4"], 8),
        (["--actor-num-nodes", "2", "--colocate"], 16),  # rollout defaults to the actor's GPUs
        (["--actor-num-gpus-per-node", "4", "--colocate", "--rollout-num-gpus", "6"], 6),
        (["--actor-num-gpus-per-node", "4", "--rollout-external-engine-addrs", "h:1", "h:2"], 4),
        (["--actor-num-gpus-per-node=4", "--rollout-num-gpus=4", "--debug-train-only"], 4),
        (["--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "2", "--debug-rollout-only"], 2),
        (["--rollout-num-gpus", "8", "--advantage-estimator", "ppo"], 16),  # critic shares the actor's
    ],
)
def test_required_gpus_follow_slimes_placement_group_layout(argv, gpus):
    assert pf.required_gpus(pf.SlimeArgs(argv)).total == gpus


def test_external_engines_need_only_the_actor():
    need, problems = _check(["--rollout-num-gpus", "16"], gpus=8, external=True)
    assert need.total == 8 and problems == []


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--rollout-num-gpus", "8"], None),
        ([], "without --colocate needs --rollout-num-gpus"),
        (["--rollout-num-gpus", "8", "--rollout-num-gpus-per-engine", "3"], "not a multiple"),
        (["--colocate", "--rollout-num-gpus", "x"], "--rollout-num-gpus 'x' is not an integer"),
        (["--colocate", "--update-weight-transport", "disk"], "needs --update-weight-disk-dir"),
        (["--colocate", "--update-weight-mode", "delta"], "needs --update-weight-transport disk, got 'nccl'"),
        (
            ["--rollout-num-gpus", "8", "--update-weight-mode", "delta", "--update-weight-transport", "disk"]
            + ["--update-weight-disk-dir", "/v/w"],
            "needs --update-weight-local-checkpoint-dir",
        ),
        (["--colocate", "--save", "/ckpt/run"], "--save /ckpt/run is not under any of the mounted Volumes"),
        (["--colocate", "--save", "/v/run", "--prompt-data", "/root/slime/data.jsonl"], None),
        (["--colocate", "--hf-checkpoint", "Qwen/Qwen3-4B"], None),  # a Hub id is not a path
    ],
)
def test_check_names_each_problem(argv, problem):
    _, problems = _check(argv)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) >= 1 and problem in problems[0], problems


def test_slime_args_reads_the_last_value_and_all_nargs():
    args = pf.SlimeArgs(["--lr", "1", "--lr=2", "--eval-prompt-data", "aime", "/a.jsonl", "--colocate"])
    assert args.get("--lr") == "2"
    assert args.values("--eval-prompt-data") == ["aime", "/a.jsonl"]
    assert args.has("--colocate") and not args.has("--col")
    assert args.int("--kl-coef", 3) == 3


def test_launcher_flag_warnings_name_each_flag_once():
    warnings = pf.launcher_flag_warnings(["--backend", "modal", "--backend=x", "--lr", "1"], {"--backend"})
    assert len(warnings) == 1 and warnings[0].startswith("warning: --backend comes after `--`")
