"""``--backend modal`` ships the local files a job names into the containers at the same path.

Offline: the Modal function and its image are built (not deployed) and read back; the plans
come from the real launchers in subprocesses with ``--dry-run``.
"""

from __future__ import annotations

import json
import os

import pytest

from modal_rl.cluster.local_inputs import MAX_SHIP_BYTES, LocalInputError, collect, hydra_values
from tests._launcher import run_module


def make_inputs(tmp_path):
    config = tmp_path / "conf" / "sandbox.yaml"
    config.parent.mkdir()
    config.write_text("modal_rl_sandbox:\n  max_live: 8\n")
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1", "label": "2"}\n')
    return config, data


def test_collect_ships_what_exists_here_outside_volumes(tmp_path):
    config, data = make_inputs(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "weights.bin").write_bytes(b"\0" * 1000)
    on_volume = "/data/on-volume.parquet"
    shipped = collect(
        [
            ("--custom-config-path", str(config)),
            ("--prompt-data", str(data)),
            ("model.path", str(model)),
            ("inner", str(model / "config.json")),  # inside a shipped directory: travels with it
            ("data.val_files", on_volume),
            ("hub", "Qwen/Qwen3-8B"),  # not a path here
            ("pkg", "pkg://verl_modal.cpu.arith_reward"),
        ],
        mounts=["/data"],
    )
    assert [(s.named_by, s.path, s.is_dir) for s in shipped] == [
        ("--custom-config-path", str(config), False),
        ("--prompt-data", str(data), False),
        ("model.path", str(model), True),
    ]
    assert shipped[2].bytes == 1002
    # nothing under a mounted Volume travels, even if it happens to exist here too
    assert collect([("x", str(config))], mounts=[str(tmp_path)]) == []


def test_relative_paths_and_the_size_cap_are_one_line_each(tmp_path, monkeypatch):
    config, _ = make_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        LocalInputError, match=rf"^--custom-config-path conf/sandbox.yaml: .* write it as {config}$"
    ):
        collect([("--custom-config-path", "conf/sandbox.yaml")])
    big = tmp_path / "big.parquet"
    with open(big, "wb") as f:
        f.truncate(MAX_SHIP_BYTES + 1)  # sparse: no disk used
    with pytest.raises(LocalInputError) as err:
        collect([("data.train_files", str(big)), ("cfg", str(config))])
    message = str(err.value)
    assert "\n" not in message
    assert "above the 50.0 MiB" in message and f"largest: data.train_files {big}" in message
    assert "--volume NAME:PATH" in message


def test_hydra_list_values():
    assert hydra_values("/a.parquet") == ["/a.parquet"]
    assert hydra_values("[/a.parquet,/b.parquet]") == ["/a.parquet", "/b.parquet"]
    assert hydra_values("['/a.parquet', \"/b.parquet\"]") == ["/a.parquet", "/b.parquet"]


def test_the_built_image_attaches_each_input_at_its_own_path(tmp_path):
    from modal_rl.cluster.backend_modal import ModalBackend, image_local_files
    from modal_rl.cluster.spec import ClusterSpec

    config, data = make_inputs(tmp_path)
    shipped = collect([("a", str(config)), ("b", str(tmp_path / "conf"))])
    backend = ModalBackend(local_files=shipped)
    backend.build_function(ClusterSpec(nodes=1, gpu="H100:8"), key="k" * 32)
    attached = image_local_files(backend.last_image)
    assert attached == [
        {"local": str(tmp_path / "conf"), "remote": str(tmp_path / "conf")}
    ]  # file inside the dir
    backend = ModalBackend(local_files=collect([("a", str(config)), ("b", str(data))]))
    backend.build_function(ClusterSpec(nodes=1, gpu="H100:8"), key="k" * 32)
    assert image_local_files(backend.last_image) == [
        {"local": str(config), "remote": str(config)},
        {"local": str(data), "remote": str(data)},
    ]


SLIME_LINE = ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate"]


def test_slime_dry_run_lists_what_travels_and_keeps_the_argv(tmp_path):
    config, data = make_inputs(tmp_path)
    line = [*SLIME_LINE, "--custom-config-path", str(config), "--prompt-data", str(data)]
    out, _ = run_module(
        "slime_modal", "--backend", "modal", "--gpu", "H100:8", "--dry-run", "--json", "--", *line
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    travels = plan["local_files"]
    assert [(f["named_by"], f["path"]) for f in travels["files"]] == [
        ("--prompt-data", str(data)),
        ("--custom-config-path", str(config)),
    ] or [(f["named_by"], f["path"]) for f in travels["files"]] == [
        ("--custom-config-path", str(config)),
        ("--prompt-data", str(data)),
    ]
    assert travels["total_bytes"] == os.path.getsize(config) + os.path.getsize(data)
    assert {(m["local"], m["remote"]) for m in travels["inspected"]} == {
        (str(config), str(config)),
        (str(data), str(data)),
    }
    assert plan["framework_argv"] == line  # byte for byte
    assert plan["entrypoint"][2:] == line


def test_slime_inputs_above_the_cap_stop_the_launch_in_one_line(tmp_path):
    big = tmp_path / "prompts.jsonl"
    with open(big, "wb") as f:
        f.truncate(MAX_SHIP_BYTES + 1)
    out, seconds = run_module(
        "slime_modal",
        "--backend",
        "modal",
        "--gpu",
        "H100:8",
        "--dry-run",
        "--json",
        "--",
        *SLIME_LINE,
        "--prompt-data",
        str(big),
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "slime_modal: local inputs for the Modal containers total 50.0 MiB"
    )
    assert seconds < 10


def test_verl_input_keys_are_found_in_the_users_overrides(tmp_path):
    from verl_modal.launch import local_input_candidates

    got = local_input_candidates(
        [
            f"data.train_files=[{tmp_path}/a.parquet,{tmp_path}/b.parquet]",
            "actor_rollout_ref.model.path=Qwen/Qwen3-8B",
            f"reward.custom_reward_function.path={tmp_path}/reward.py",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path}/tools.yaml",
            "trainer.default_local_dir=/ckpt/run",  # an output, not an input
            "data.train_batch_size=256",
        ]
    )
    assert got == [
        ("data.train_files", f"{tmp_path}/a.parquet"),
        ("data.train_files", f"{tmp_path}/b.parquet"),
        ("actor_rollout_ref.model.path", "Qwen/Qwen3-8B"),
        ("reward.custom_reward_function.path", f"{tmp_path}/reward.py"),
        ("actor_rollout_ref.rollout.multi_turn.tool_config_path", f"{tmp_path}/tools.yaml"),
    ]


@pytest.mark.slow  # composes and validates verl's config (imports verl): 10-20 s
def test_verl_dry_run_ships_a_local_parquet_and_reward_file(tmp_path):
    train = tmp_path / "train.parquet"
    train.write_bytes(b"PAR1" + b"\0" * 100)
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(*a, **k):\n    return 0.0\n")
    from tests.verl_adapter.test_verl_launch import VERL_LINE

    line = [
        *(o for o in VERL_LINE if not o.startswith(("data.train_files=", "data.val_files="))),
        f"data.train_files={train}",
        "data.val_files=/data/test.parquet",  # on the Volume: not shipped
        f"reward.custom_reward_function.path={reward}",
    ]
    out, _ = run_module(
        "verl_modal",
        "--backend",
        "modal",
        "--gpu",
        "H100:8",
        "--volume",
        "data:/data",
        "--dry-run",
        "--json",
        "--",
        *line,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    plan = json.loads(out.stdout)
    files = plan["local_files"]["files"]
    assert [(f["named_by"], f["path"]) for f in files] == [
        ("data.train_files", str(train)),
        ("reward.custom_reward_function.path", str(reward)),
    ]
    assert {m["remote"] for m in plan["local_files"]["inspected"]} == {str(train), str(reward)}
    assert plan["framework_argv"] == line
    assert plan["entrypoint"][-len(line) :] == line
