"""The local run's own lines: verl's per-step dict -> one compact line; the summary table;
the watcher that turns verl's ``file`` tracking backend into those lines; the output redirect.

The full path (a real verl run) is checked in ``test_verl_cpu_run.py``; these run in a second.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

from verl_modal import console

ROOT = Path(__file__).resolve().parents[2]

STEP = {  # the keys verl 0.9.1 logs, values as its file logger writes them
    "critic/score/mean": 0.09375,
    "response_length/mean": 32.0,
    "timing_s/update_weights": 0.1085,
    "timing_s/step": 28.64,
    "training/rollout_actor_probs_pearson_corr": 0.9989,
    "actor/pg_loss": 0.0,
}


def test_step_line_has_the_few_metrics_that_matter():
    rec = console.step_record(1, STEP, weights_mib=1.71)
    assert console.step_line(rec, 3) == (
        "step 1/3 | reward 0.094 | response 32.0 tok | sync 1.71 MiB in 0.11 s | step 28.6 s | rollout/actor corr 0.999"
    )
    # a delta checkpoint engine reports its own payload and send time
    delta = console.step_record(
        2, {"checkpoint_engine/payload_mbytes": 0.51, "checkpoint_engine/send_s": 0.12}, 1.71
    )
    assert (delta.sync_mib, delta.sync_s, delta.reward) == (0.51, 0.12, None)
    assert "reward n/a" in console.step_line(delta, None) and "step 2 |" in console.step_line(delta, None)


def test_sync_is_one_number_for_console_report_and_tensorboard():
    # Step 1 of the main job as metrics.jsonl holds it: verl's own timer saw only the step's
    # sync; modal_rl/weight_sync/* (the report's and tensorboard's) count the start-up one too.
    step1 = {
        **STEP,
        "modal_rl/weight_sync/syncs": 2.0,
        "modal_rl/weight_sync/sent_mib": 0.718,
        "modal_rl/weight_sync/seconds": 2.33,
        "checkpoint_engine/payload_mbytes": 0.51,
    }
    rec = console.step_record(1, step1, weights_mib=1.71)
    assert (rec.sync_mib, rec.sync_s, rec.syncs) == (0.718, 2.33, 2)
    assert "sync 0.72 MiB in 2.33 s (2 syncs) |" in console.step_line(rec, 3)
    step2 = {**STEP, **{k: v for k, v in step1.items() if k.startswith("modal_rl/")}}
    step2.update({"modal_rl/weight_sync/syncs": 1.0, "modal_rl/weight_sync/seconds": 0.05})
    line = console.step_line(console.step_record(2, step2, 1.71), 3)
    assert "sync 0.72 MiB in 0.05 s | step" in line and "syncs" not in line
    # a delta of a few KiB keeps its digits
    assert console.mib_text(0.0033540725708007812) == "0.00335 MiB" and console.mib_text(0.0) == "0.00 MiB"
    assert console.mib_text(0.7151556) == "0.72 MiB" and console.mib_text(None) == "n/a"


def test_summary_table(tmp_path):
    files = console.RunFiles.make(tmp_path)
    steps = [console.step_record(i, {**STEP, "critic/score/mean": 0.1 * i}, 1.71) for i in (1, 2, 3)]
    lines = console.summary_lines(steps, wall_s=214.4, total=3, files=files, checkpoints="none", ok=True)
    assert lines[0] == "summary" and set(lines[1]) == {"-"} and lines[-1] == lines[1]
    rows = {line[:18].strip(): line[20:] for line in lines[2:-1]}
    assert rows["steps"] == "3 of 3" and rows["wall time"] == "3 min 34 s"
    assert rows["reward mean"] == "0.100 -> 0.200 -> 0.300"
    assert rows["weight sync / step"] == "1.71 MiB in 0.11 s (mean)"
    assert rows["log"] == str(files.log) and rows["metrics"] == str(files.metrics)
    assert rows["result"] == "finished"


def test_watcher_turns_verls_metrics_file_and_log_into_our_lines(tmp_path):
    files = console.RunFiles.make(tmp_path)
    out = io.StringIO()
    watcher = console.Watcher(files, console.Progress(out), total=2, weights_mib=1.0)
    files.log.write_text("(CpuTaskRunner pid=1) [verl_modal] TaskRunner on verl platform 'cpu'\nhalf a li")
    with open(files.metrics, "w") as f:  # verl.utils.tracking.FileLogger's format
        f.write(json.dumps({"step": 1, "data": STEP}) + "\n" + '{"step": 2, "da')
    watcher.poll()
    said = out.getvalue().splitlines()
    assert len(said) == 2 and "TaskRunner is up" in said[0] and "step 1/2 | reward 0.094" in said[1]
    with open(files.metrics, "a") as f:
        f.write('ta": {"critic/score/mean": 0.5}}\n')
    watcher.poll()
    assert "step 2/2 | reward 0.500" in out.getvalue().splitlines()[-1]
    assert [s.step for s in watcher.steps] == [1, 2]


def test_the_sync_phase_is_seen_on_either_sync_path(tmp_path):
    for marker in (
        "(WorkerDict pid=2) [verl_modal.cpu] vLLM layer-wise weight reload: 12 tensors",
        "(vLLMHttpServer pid=3) [modal_rl.weightsync] vllm loaded version 0: full load in 0.46s",
    ):
        files = console.RunFiles.make(tmp_path)
        out = io.StringIO()
        watcher = console.Watcher(files, console.Progress(out), total=1, weights_mib=1.0)
        files.log.write_text(
            "[verl_modal] TaskRunner on verl platform 'cpu'\n(vLLMHttpServer pid=3) up\n" + marker + "\n"
        )
        watcher.poll()
        assert "actor weights synced into vLLM; training" in out.getvalue().splitlines()[-1], marker


def test_output_goes_to_the_log_and_comes_back(tmp_path):
    log = tmp_path / "run.log"
    code = (
        "import os, sys; from pathlib import Path; from verl_modal.console import output_to\n"
        f"with output_to(Path({str(log)!r})) as terminal:\n"
        "    print('verl says a lot'); os.system('echo a child says more 1>&2')\n"
        "    terminal.write('ours\\n')\n"
        "print('after')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "ours\nafter\n" and out.stderr == ""
    assert log.read_text() == "verl says a lot\na child says more\n"


def test_checkpoint_numel_reads_safetensors_headers(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    save_file(
        {"a": np.zeros((3, 4), np.float32), "b": np.zeros(5, np.float16)}, str(tmp_path / "model.safetensors")
    )
    assert console.checkpoint_numel(tmp_path) == 17


def test_a_quiet_stretch_gets_a_still_working_line_within_the_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(console, "QUIET_S", 0.6)
    monkeypatch.setattr(console, "POLL_S", 0.05)
    files = console.RunFiles.make(tmp_path)
    files.log.write_text("ray starting\n")
    out = io.StringIO()
    watcher = console.Watcher(files, console.Progress(out), total=2, weights_mib=1.0)
    start = time.monotonic()
    watcher.start()
    try:
        # a loaded host may stall the thread, so the bound below is on lines per elapsed time
        deadline = start + 30.0
        while len(out.getvalue().splitlines()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        watcher.finish()
    elapsed = time.monotonic() - start
    said = out.getvalue().splitlines()
    assert said and all("still working, waiting until: verl's TaskRunner is up" in line for line in said)
    assert 2 <= len(said) <= elapsed / 0.6 + 1  # one per quiet stretch, not one per poll
