"""The run report: one self-contained static HTML page (``report.html`` in the run folder).

What it shows: what the run was (command line, git commit, package versions, wall time,
exit status: :mod:`.provenance`); per step, reward and response length, the framework's
own loss, KL, entropy and throughput (:mod:`.framework_plots`), weight-sync size (anchor vs
delta, per receiver), time and engine pause, the sandbox pool against its adaptive target,
lease waits and create times, masked samples by cause, engine replacements on a timeline;
a few of the last step's generations (:mod:`.samples`); then a table of every number the
run logged per step (``modal_rl/`` first, then the framework's own) and the run's config
summary.

Invariants: the page loads nothing (no scripts, styles, fonts or images from anywhere: the
plots are inline SVG, :mod:`.plots`); every number in its table is the run's
``metrics.jsonl`` value: shown to 6 significant digits (:func:`fmt`), held exactly in the
cell's ``data-value`` (``repr``, which reads back equal); the step numbers' own JSON is embedded (``<script type="application/json"
id="run-data">``, data, never run) for anyone who wants the exact values.
"""

from __future__ import annotations

import html
import json
import time
from pathlib import Path

from modal_rl.report import framework_plots, plots, samples
from modal_rl.report.numbers import PREFIX
from modal_rl.report.run_dir import GENERATIONS, REPORT, RunData, load

STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:64em;color:#222;padding:0 1em}
h1{font-size:1.4em}h2{font-size:1.1em;margin-top:1.6em;border-bottom:1px solid #ddd}
figure{margin:1em 0}figcaption{font-weight:600;margin-bottom:.3em}svg{max-width:100%;height:auto}
table{border-collapse:collapse;font-size:.85em}td,th{border:1px solid #ddd;padding:.2em .5em;text-align:right}
th:first-child,td:first-child{text-align:left}.note{color:#666;font-size:.9em}
.scroll{overflow-x:auto}#facts td{text-align:left}
.sample{border:1px solid #ddd;margin:.6em 0;padding:.4em .6em}
.sample pre{white-space:pre-wrap;word-break:break-word;margin:.2em 0;font-size:.85em;background:#f7f7f7}
"""


def fmt(value: float) -> str:
    """A number as the table shows it: 6 significant digits, integers plainly."""
    shown = float(f"{float(value):.6g}")
    return str(int(shown)) if shown.is_integer() and abs(shown) < 1e15 else repr(shown)


def exact(value: float) -> str:
    """A number as the table's ``data-value`` holds it: ``repr``, which reads back equal."""
    return repr(float(value))


def table_names(run: RunData) -> list[str]:
    """Every name the run logged: the reward and length, ``modal_rl/``'s, then the rest."""
    first = [k for k in (*plots.REWARD_KEYS, *plots.LENGTH_KEYS) if run.series(k)][:2]
    ours = [k for k in run.names() if k.startswith(PREFIX)]
    return first + ours + [k for k in run.names() if k not in first and not k.startswith(PREFIX)]


def _esc(text) -> str:
    return html.escape(str(text), quote=True)


def _config_rows(run: RunData) -> str:
    config = run.info.get("config") or {}
    if not config:
        return "<p class='note'>No config summary (run.json) in this folder.</p>"
    rows = "".join(f"<tr><td>{_esc(k)}</td><td>{_esc(v)}</td></tr>" for k, v in config.items())
    return f"<table id='config'><tr><th>setting</th><th>value</th></tr>{rows}</table>"


def run_facts(run: RunData) -> list[tuple[str, str]]:
    """The first table's rows: what the run was and how it ended (``run.json``)."""
    info = run.info
    tb = run.tensorboard
    versions = info.get("versions") or {}
    if "exit_code" in info:
        ended = f"{info.get('status', '?')} (exit {info['exit_code']})"
    else:
        ended = "not recorded (the run is still going, or it was killed)"
    wall = info.get("wall_s")
    facts = [
        ("command", str(info.get("command") or "not recorded")),
        ("git", str(info.get("git") or "not recorded")),
        ("versions", ", ".join(f"{k} {v}" for k, v in versions.items()) or "not recorded"),
        ("exit status", ended),
        ("wall time", f"{float(wall):.1f} s" if isinstance(wall, int | float) else "not recorded"),
        ("run folder", str(run.path.resolve())),
        ("framework", info.get("framework") or "unknown"),
        ("steps", str(len(run.steps))),
        ("tensorboard", str(tb) if tb else "none (add tensorboard to trainer.logger)"),
        ("engine events", str(len(run.events))),
    ]
    if run.skipped:
        facts.append(("skipped records", str(run.skipped)))
    return facts


def _samples(run: RunData) -> str:
    got = samples.read(run.path / GENERATIONS)
    if not got:
        return (
            f"<p class='note'>No generations in this folder ({GENERATIONS}/&lt;step&gt;.jsonl, verl's "
            "trainer.rollout_data_dir).</p>"
        )
    blocks = [
        f"<p class='note'>The first {len(got)} samples of step {got[0].step} "
        f"({GENERATIONS}/{got[0].step}.jsonl).</p>"
    ]
    for i, s in enumerate(got):
        reward = "n/a" if s.reward is None else fmt(s.reward)
        blocks.append(
            f"<div class='sample' id='sample-{i}'><b>reward</b> <span class='reward'>{_esc(reward)}</span>"
            f"<br><b>prompt</b><pre>{_esc(s.prompt)}</pre><b>response</b><pre>{_esc(s.response)}</pre></div>"
        )
    return "".join(blocks)


def _steps_table(run: RunData) -> str:
    names = table_names(run)
    steps = sorted(run.steps)
    head = "".join(f"<th>{s}</th>" for s in steps)
    body = []
    for name in names:
        cells = "".join(
            f"<td data-name='{_esc(name)}' data-step='{s}' data-value='{exact(run.steps[s][name])}'>"
            f"{fmt(run.steps[s][name])}</td>"
            if name in run.steps[s]
            else "<td></td>"
            for s in steps
        )
        body.append(f"<tr><td>{_esc(name)}</td>{cells}</tr>")
    return (
        f"<div class='scroll'><table id='steps'><tr><th>metric \\ step</th>{head}</tr>{''.join(body)}"
        "</table></div>"
    )


def _figures(run: RunData) -> list[tuple[str, str]]:
    """Reward and length, the framework's training curves, then modal-rl's own."""
    ours = plots.draw(run)
    first = [f for f in ours if f[0].startswith("Reward")]
    return first + framework_plots.draw(run) + [f for f in ours if f not in first]


def render(run: RunData) -> str:
    n_steps = len(run.steps)
    why_not = plots.available()
    figures = (
        [f"<p class='note'>{_esc(why_not)}</p>"]
        if why_not
        else [f"<figure><figcaption>{_esc(t)}</figcaption>{svg}</figure>" for t, svg in _figures(run)]
    )
    facts = run_facts(run)
    facts_html = "".join(
        f"<tr><td>{_esc(k)}</td><td id='fact-{k.replace(' ', '-')}'>{_esc(v)}</td></tr>" for k, v in facts
    )
    data = json.dumps(
        {"steps": {str(s): run.steps[s] for s in sorted(run.steps)}, "events": run.events}, default=str
    ).replace("</", "<\\/")
    made = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return "\n".join(
        [
            "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
            "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; style-src 'unsafe-inline'; "
            'img-src data:">',
            f"<title>modal-rl run report: {n_steps} steps</title><style>{STYLE}</style></head><body>",
            f"<h1>modal-rl run report: <span id='step-count'>{n_steps}</span> steps</h1>",
            f"<p class='note'>Made {made} by <code>python -m modal_rl.report</code>; "
            "numbers from the run's metrics.jsonl.</p>",
            f"<table id='facts'>{facts_html}</table>",
            "<h2>Per step</h2>",
            *figures,
            "<h2>Sample generations</h2>",
            _samples(run),
            "<h2>Every number, per step</h2>",
            _steps_table(run),
            "<h2>Config</h2>",
            _config_rows(run),
            f"<script type='application/json' id='run-data'>{data}</script>",
            "</body></html>",
        ]
    )


def write(run_dir: Path) -> Path:
    """Render the run folder's report into ``run_dir/report.html``; returns its path."""
    run = load(run_dir)
    out = Path(run_dir) / REPORT
    tmp = out.with_suffix(".tmp")
    tmp.write_text(render(run), encoding="utf-8")
    tmp.replace(out)
    return out
