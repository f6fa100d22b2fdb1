"""What the report says a run was (command line, git commit, versions, wall time, exit
status), the framework's own training curves and a few sample generations, read from a
metrics.jsonl and a rollout dump that a real verl 0.9.1 CPU run wrote
(tests/report/fixtures/verl-cpu-run: ``bash scripts/main.sh``'s command, 3 GRPO steps)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from modal_rl.report import framework_plots, provenance, samples
from modal_rl.report.page import write
from modal_rl.report.run_dir import load, write_info, write_outcome
from modal_rl.text_safety import clean

ROOT = Path(__file__).resolve().parents[2]
RECORDED = Path(__file__).parent / "fixtures" / "verl-cpu-run"


@pytest.fixture
def recorded(tmp_path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(RECORDED, run_dir)
    return run_dir


def test_git_commit_is_this_checkouts_and_a_plain_folder_is_not_a_checkout(tmp_path):
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    got = provenance.git_commit()
    assert got.removesuffix("+dirty") == head.stdout.strip() and len(head.stdout.strip()) == 40
    assert provenance.git_commit(tmp_path) == provenance.NOT_A_CHECKOUT


def test_versions_name_the_installed_stack_and_leave_out_the_rest():
    got = provenance.versions()
    assert {"modal-rl", "verl", "torch", "ray"} <= set(got)
    assert "sglang" not in got or got["sglang"]  # installed or absent, never an empty string
    assert provenance.versions(("no-such-distribution-here",)) == {}


def test_command_line_reads_back_and_carries_no_run_key(monkeypatch):
    from modal_rl.run_key import RUN_KEY_ENV

    key = "k" * 43
    monkeypatch.setenv(RUN_KEY_ENV, key)
    line = provenance.command_line(["python", "-m", "verl_modal", "--", "a b=1", f"x={key}"])
    assert key not in line and line.startswith("python -m verl_modal -- 'a b=1' ")


def test_run_json_holds_the_start_and_the_end(tmp_path):
    write_info(tmp_path, "verl", {"algorithm.adv_estimator": "grpo"}, ["python", "-m", "verl_modal"])
    write_outcome(tmp_path, 1, 12.5)
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["command"] == "python -m verl_modal" and info["config"]["algorithm.adv_estimator"] == "grpo"
    assert (info["exit_code"], info["status"], info["wall_s"]) == (1, "failed", 12.5)
    assert info["ended"] >= info["started"] and "modal-rl" in info["versions"]
    (tmp_path / "new").mkdir()
    write_outcome(tmp_path / "new", 0, 1.0)  # a folder without run.json gets the end facts alone
    assert json.loads((tmp_path / "new" / "run.json").read_text())["status"] == "finished"


def test_the_recorded_run_logs_verls_training_curves(recorded):
    run = load(recorded)
    assert sorted(run.steps) == [1, 2, 3]
    drawn = framework_plots.names_drawn(run)
    assert drawn[0] == "actor/pg_loss" and "actor/entropy" in drawn and "perf/throughput" in drawn
    assert drawn[1] in ("actor/kl_loss", "actor/ppo_kl")


def test_report_of_the_recorded_run_says_what_ran_and_how_it_ended(recorded):
    write_info(recorded, "verl", {"trainer.total_training_steps": "3"}, ["python", "-m", "verl_modal"])
    write_outcome(recorded, 0, 301.25)
    page = write(recorded).read_text()
    for fact, text in (
        ("command", "python -m verl_modal"),
        ("exit-status", "finished (exit 0)"),
        ("wall-time", "301.2 s"),
        ("git", provenance.git_commit()),
    ):
        assert f"<td id='fact-{fact}'>{text}</td>" in page, fact
    assert "modal-rl " in page.split("id='fact-versions'>")[1].split("<")[0]
    assert "Training: policy loss, KL, entropy, throughput" in page
    # every number verl logged has a row, not only ours
    steps = json.loads((recorded / "metrics.jsonl").read_text().splitlines()[0])["data"]
    for name in steps:
        assert f"data-name='{name}' data-step='1'" in page, name


def test_a_run_that_did_not_end_says_so(recorded):
    page = write(recorded).read_text()
    assert "<td id='fact-exit-status'>not recorded" in page
    assert "<td id='fact-git'>not recorded</td>" in page  # the fixture's run.json has no start facts


def test_samples_are_the_last_steps_cleaned_and_cut(recorded):
    got = samples.read(recorded / "generations")
    assert len(got) == samples.SHOWN and {s.step for s in got} == {3}
    first = json.loads((recorded / "generations" / "3.jsonl").read_text().splitlines()[0])
    assert got[0].reward == first["score"] and got[0].response == clean(first["output"], multiline=True)
    hostile = recorded / "generations" / "4.jsonl"
    evil = "\x1b]52;c;ZXZpbA==\x07ok\u202e\x9b31m" + "x" * 5000
    hostile.write_text(
        json.dumps({"input": "<script>q</script>", "output": evil, "score": 1.0, "step": 4})
        + "\nnot json\n"
        + json.dumps({"input": "q", "output": "a", "score": float("nan"), "step": 4})
        + "\n"
    )
    got = samples.read(recorded / "generations")
    assert [s.step for s in got] == [4, 4] and got[1].reward is None
    text = got[0].response
    assert text.startswith("ok") and "\x1b" not in text and "\u202e" not in text and "\x9b" not in text
    assert len(text) < samples.MAX_CHARS + 60 and text.endswith("more characters)")
    page = write(recorded).read_text()
    assert "<script>q" not in page and "&lt;script&gt;q&lt;/script&gt;" in page
    assert "The first 2 samples of step 4" in page


def test_no_dump_is_one_note(recorded):
    shutil.rmtree(recorded / "generations")
    assert samples.read(recorded / "generations") == []
    assert "No generations in this folder" in write(recorded).read_text()


def test_a_recorded_run_gets_its_end_facts_however_it_ends(tmp_path):
    from modal_rl.report.run_dir import recorded as record

    def info(folder: Path) -> dict:
        return json.loads((folder / "run.json").read_text())

    assert record(tmp_path / "ok", "slime", {"lr": "1e-6"}, lambda: 0, ["python", "-m", "x"]) == 0
    got = info(tmp_path / "ok")
    assert got["framework"] == "slime" and got["config"] == {"lr": "1e-6"}
    assert got["command"] == "python -m x" and got["git"] and "modal-rl" in got["versions"]
    assert (got["exit_code"], got["status"]) == (0, "finished") and got["wall_s"] >= 0
    assert record(tmp_path / "three", "slime", {}, lambda: 3) == 3
    assert (info(tmp_path / "three")["exit_code"], info(tmp_path / "three")["status"]) == (3, "failed")

    def broken() -> int:
        raise OSError("boom")

    with pytest.raises(OSError, match="boom"):
        record(tmp_path / "raised", "slime", {}, broken)
    assert (info(tmp_path / "raised")["exit_code"], info(tmp_path / "raised")["status"]) == (1, "failed")

    def interrupted() -> int:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        record(tmp_path / "stopped", "slime", {}, interrupted)
    stopped = info(tmp_path / "stopped")
    assert (stopped["exit_code"], stopped["status"]) == (130, "interrupted")
