"""What a real verl run leaves for a person to look at: for the main job (3 GRPO steps on
this CPU, ``trainer.logger=[console,tensorboard]``), the ``modal_rl/`` numbers in verl's
tensorboard event files for every step and the run report (numbers equal to metrics.jsonl,
rendered with every plot in headless Chromium); for the sandboxed run, its sandbox pool per
step, drawn.

Needs the stack from ``scripts/install_verl_cpu.sh``; the runs are the session's
(``tests/verl_runs.py``), shared with tests/e2e/test_verl_cpu_run.py and
tests/e2e/test_verl_sandbox_cpu_run.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.report.test_report_browser import check_rendered
from tests.report.test_report_page import _Cells
from tests.verl_runs import MAIN_STEPS as STEPS
from tests.verl_runs import SANDBOXED_STEPS

# Every step of a local run logs these, whichever parts it uses (zero included).
EVERY_STEP = [
    f"modal_rl/weight_sync/{k}"
    for k in (
        "syncs",
        "anchors",
        "deltas",
        "sent_mib",
        "raw_mib",
        "seconds",
        "engine_pause_s",
        "refused_frames",
    )
] + [f"modal_rl/masked/{k}" for k in ("samples", "sandbox", "engine")]


@pytest.fixture(scope="module")
def run(main_job):
    """The main job's run (tests/verl_runs.py: scripts/main.sh's command, once a session)."""
    return main_job.run_dir, main_job.ours


def _logged(run_dir: Path) -> dict[int, dict]:
    return {
        r["step"]: r["data"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    }


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_tensorboard_holds_the_modal_rl_scalars_of_every_step(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, ours = run
    rows = dict(
        re.match(r"verl_modal: (\S+(?: \S+)*?)\s{2,}(.*)$", line).groups()
        for line in ours[ours.index("verl_modal: summary") + 2 : -1]
    )
    assert rows["tensorboard"] == str(run_dir / "tensorboard")
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    logged = _logged(run_dir)
    for name in EVERY_STEP:
        assert name in tags, sorted(t for t in tags if t.startswith("modal_rl/"))
        points = {e.step: e.value for e in events.Scalars(name)}
        assert sorted(points) == list(range(1, STEPS + 1)), (name, points)
        for step, value in points.items():  # tensorboard keeps float32
            assert value == pytest.approx(logged[step][name], rel=1e-6, abs=1e-6), (name, step)
    # the colocated run syncs in place from deltas (verl_modal.colocated_sync): the start-up
    # anchor in step 1, then one delta per step, far smaller than the weights
    sent = [logged[s]["modal_rl/weight_sync/sent_mib"] for s in range(1, STEPS + 1)]
    raw = [logged[s]["modal_rl/weight_sync/raw_mib"] for s in range(1, STEPS + 1)]
    assert all(v > 0 for v in sent) and all(
        0 < s < 0.2 * r for s, r in zip(sent[1:], raw[1:], strict=True)
    ), (sent, raw)
    assert logged[1]["modal_rl/weight_sync/syncs"] == 2  # the start-up sync, and step 1's
    assert all(logged[s]["modal_rl/weight_sync/syncs"] == 1 for s in range(2, STEPS + 1))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_runs_report_equals_its_metrics_and_renders_in_chromium(run, tmp_path):
    run_dir, ours = run
    report = run_dir / "report.html"
    assert f"verl_modal: report              {report}" in ours
    parser = _Cells()
    parser.feed(report.read_text())
    logged = _logged(run_dir)
    for step, data in logged.items():
        for name, value in data.items():
            if name.startswith("modal_rl/"):
                assert float(parser.values[(name, step)]) == float(value), (name, step)
    # reward/length, verl's loss/KL/entropy/throughput, weight sync, masks
    dom = check_rendered(report, tmp_path, steps=STEPS, plots=4)
    assert "grpo" in dom and str(run_dir / "tensorboard") in dom
    # what ran and how it ended, and a few of the last step's generations (verl's rollout dump)
    info = json.loads((run_dir / "run.json").read_text())
    assert info["command"].startswith("python -m verl_modal --backend local --tiny ")
    assert (info["exit_code"], info["status"]) == (0, "finished") and info["wall_s"] > 0
    assert {"modal-rl", "verl", "torch", "vllm", "ray"} <= set(info["versions"])
    assert "finished (exit 0)" in dom and "Training: policy loss" in dom
    assert sorted(int(p.stem) for p in (run_dir / "generations").glob("*.jsonl")) == list(range(1, STEPS + 1))
    assert f"samples of step {STEPS}" in dom


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_sandboxed_run_logs_its_pool_per_step_and_draws_it(sandboxed_job, tmp_path):
    # --tiny-task code: every sample is scored in bubblewrap sandboxes by the modal_sandbox
    # reward manager, whose snapshots reach the TaskRunner through the run's parts folder.
    run_dir = sandboxed_job.run_dir
    logged = _logged(run_dir)
    assert sorted(logged) == list(range(1, SANDBOXED_STEPS + 1))
    for step, data in logged.items():
        # batch 4 prompts x 2 samples, each scored once; no sandbox failed, none masked
        assert data["modal_rl/sandbox/samples"] == 8, (step, data)
        assert data["modal_rl/sandbox/errors"] == 0 and data["modal_rl/masked/samples"] == 0
        assert data["modal_rl/sandbox/pool_live"] >= 1 and data["modal_rl/sandbox/pool_target"] >= 1
        assert 0 < data["modal_rl/sandbox/create_p50_s"] <= data["modal_rl/sandbox/create_p99_s"]
    dom = check_rendered(
        run_dir / "report.html", tmp_path, steps=SANDBOXED_STEPS, plots=5
    )  # + the sandbox pool
    assert "Sandbox pool" in dom
