"""The `modal-rl` command: dispatch, --version, missing extras as one install line, run names
(--name, --detach) and `status|logs|stop`, checked offline against the plan and a listing in
the shape `modal app list --json` prints; the live check needs MODAL_TOKEN_ID."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from modal_rl.cli import main as M
from modal_rl.cli import runs
from modal_rl.cli_errors import EXIT_BAD_INPUT, UserError, describe, missing_extra
from modal_rl.cluster import cli

ROOT = Path(__file__).resolve().parents[2]


def test_version_help_and_unknown_commands(capsys):
    assert M.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"modal-rl {M.version()}"
    assert M.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in M.COMMANDS)
    assert M.main([]) == 2  # no command: the usage, and a failing status
    assert M.main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_python_m_forms_and_the_console_script_agree():
    r = subprocess.run(
        [sys.executable, "-m", "modal_rl", "weightsync", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "encode" in r.stdout and "inspect" in r.stdout, r.stderr


@pytest.mark.parametrize(
    ("module", "extra"),
    [("hydra.core", "verl"), ("modal", "modal"), ("ray.util", "local"), ("matplotlib.pyplot", "verl")],
)
def test_a_missing_extra_is_one_line_with_the_install_command(module, extra):
    exc = ModuleNotFoundError(f"No module named '{module}'", name=module)
    line, code = describe(exc)
    assert code == EXIT_BAD_INPUT and "\n" not in line
    assert f"pip install 'modal-rl[{extra}]'" in line and repr(module.split(".")[0]) in line


def test_torch_and_own_modules():
    torch_line = missing_extra(ModuleNotFoundError("x", name="torch"))
    assert "download.pytorch.org/whl/cpu" in torch_line  # the CPU build, not CUDA by default
    assert missing_extra(ModuleNotFoundError("x", name="modal_rl.nope")) is None  # a broken install
    assert missing_extra(ValueError("x")) is None


def test_a_subcommand_whose_module_is_missing_names_its_extra(monkeypatch, capsys):
    def fail(name):
        raise ModuleNotFoundError("No module named 'hydra'", name="hydra")

    monkeypatch.setattr(M.importlib, "import_module", fail)
    assert M.main(["verl", "--help"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("modal-rl verl: ") and "pip install 'modal-rl[verl]'" in err


def _plan(argv, capsys):
    ours, theirs = cli.split_passthrough(argv)
    parser = argparse.ArgumentParser()
    cli.add_cluster_args(parser)
    args = parser.parse_args(ours)
    code = cli.run_job(cli.spec_from_args(args), ["python3", "train.py", *theirs], **_opts(args))
    return code, capsys.readouterr()


def _opts(args):
    return {"backend": args.backend, **cli.run_options(args)}


def test_name_sets_the_modal_app(capsys):
    code, out = _plan(
        ["--backend", "modal", "--gpu", "H100:8", "--name", "grpo-7b", "--dry-run", "--json"], capsys
    )
    assert code == 0, out.err
    assert json.loads(out.out)["app"] == "grpo-7b"
    code, out = _plan(["--backend", "modal", "--gpu", "H100:8", "--dry-run", "--json"], capsys)
    assert json.loads(out.out)["app"] == "modal-rl-cluster"  # a run that is not detached


def test_a_bad_name_is_refused_by_the_parser(capsys):
    parser = argparse.ArgumentParser()
    cli.add_cluster_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--name", "no spaces/here"])
    assert "letters, digits" in capsys.readouterr().err


def test_detach_prints_the_run_name_and_the_commands(monkeypatch, capsys):
    from modal_rl.cluster.backend_modal import ModalBackend

    seen = {}

    def spawn(self, spec, job):
        seen["app"] = self.app_name
        return "fc-123"

    monkeypatch.setattr(ModalBackend, "spawn", spawn)
    code, out = _plan(["--backend", "modal", "--gpu", "H100:8", "--detach"], capsys)
    assert code == 0, out.err
    printed = json.loads(out.out)
    assert printed == {"detached": True, "name": seen["app"], "function_call_id": "fc-123"}
    assert seen["app"].startswith("modal-rl-") and seen["app"] != "modal-rl-cluster"
    assert f"modal-rl logs {seen['app']}" in out.err and f"modal-rl stop {seen['app']}" in out.err


LISTING = [  # the shape of `modal app list --json` (modal 1.6)
    {"app_id": "ap-old", "description": "grpo", "state": "stopped", "tasks": "0", "created_at": "2026-01-01"},
    {
        "app_id": "ap-new",
        "description": "grpo",
        "state": "ephemeral (detached)",
        "tasks": "2",
        "created_at": "2026-01-02",
    },
    {
        "app_id": "ap-else",
        "description": "other",
        "state": "deployed",
        "tasks": "1",
        "created_at": "2026-01-03",
    },
]


def test_find_app_prefers_the_running_newest_of_the_name():
    assert runs.find_app(LISTING, "grpo")["app_id"] == "ap-new"
    titled = [{"App ID": "ap-x", "Description": "t", "State": "deployed", "Created at": "1"}]  # older titles
    assert runs._field(runs.find_app(titled, "t"), "app_id") == "ap-x"
    with pytest.raises(UserError, match="no Modal app named 'nope'"):
        runs.find_app(LISTING, "nope")


def test_run_commands_dry_run_print_modals_own_commands(capsys):
    assert runs.main("logs", ["grpo", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split("  #")[0].endswith("-m modal app list --json")
    assert out[1].endswith("-m modal app logs --follow <app id>")
    assert runs.main("stop", ["grpo", "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines()[1].endswith("app stop --yes <app id>")
    assert runs.main("status", ["bad name", "--dry-run"]) == 2
    assert "is not a run name" in capsys.readouterr().err


@pytest.mark.modal_live
@pytest.mark.skipif(not os.environ.get("MODAL_TOKEN_ID"), reason="needs MODAL_TOKEN_ID and a Modal server")
def test_live_status_of_an_unknown_run_is_one_line():
    r = subprocess.run(
        [sys.executable, "-m", "modal_rl", "status", "modal-rl-no-such-run-0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "no Modal app named" in r.stderr, r.stderr


def test_bench_finds_the_checkouts_suites_from_any_directory(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "modal_rl", "bench", "list"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "weight-sync" in r.stdout.split(), r.stderr
