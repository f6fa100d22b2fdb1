"""The run report: one self-contained static HTML page (``report.html`` in the run folder).

What it shows, per step: reward and response length; weight-sync size (anchor vs delta, per
receiver), time and engine pause; the sandbox pool against its adaptive target, lease
waits and create times; masked samples by cause; engine replacements on a timeline; then
the run's config summary and a table of every ``modal_rl/`` number (and the reward and
length) per step.

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

from modal_rl.report import plots
from modal_rl.report.numbers import PREFIX
from modal_rl.report.run_dir import REPORT, RunData, load

STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:64em;color:#222;padding:0 1em}
h1{font-size:1.4em}h2{font-size:1.1em;margin-top:1.6em;border-bottom:1px solid #ddd}
figure{margin:1em 0}figcaption{font-weight:600;margin-bottom:.3em}svg{max-width:100%;height:auto}
table{border-collapse:collapse;font-size:.85em}td,th{border:1px solid #ddd;padding:.2em .5em;text-align:right}
th:first-child,td:first-child{text-align:left}.note{color:#666;font-size:.9em}
.scroll{overflow-x:auto}
"""


def fmt(value: float) -> str:
    """A number as the table shows it: 6 significant digits, integers plainly."""
    shown = float(f"{float(value):.6g}")
    return str(int(shown)) if shown.is_integer() and abs(shown) < 1e15 else repr(shown)


def exact(value: float) -> str:
    """A number as the table's ``data-value`` holds it: ``repr``, which reads back equal."""
    return repr(float(value))


def table_names(run: RunData) -> list[str]:
    names = [k for k in (*plots.REWARD_KEYS, *plots.LENGTH_KEYS) if run.series(k)][:2]
    return names + [k for k in run.names() if k.startswith(PREFIX)]


def _esc(text) -> str:
    return html.escape(str(text), quote=True)


def _config_rows(run: RunData) -> str:
    config = run.info.get("config") or {}
    if not config:
        return "<p class='note'>No config summary (run.json) in this folder.</p>"
    rows = "".join(f"<tr><td>{_esc(k)}</td><td>{_esc(v)}</td></tr>" for k, v in config.items())
    return f"<table id='config'><tr><th>setting</th><th>value</th></tr>{rows}</table>"


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


def render(run: RunData) -> str:
    framework = run.info.get("framework", "")
    n_steps = len(run.steps)
    why_not = plots.available()
    figures = (
        [f"<p class='note'>{_esc(why_not)}</p>"]
        if why_not
        else [f"<figure><figcaption>{_esc(t)}</figcaption>{svg}</figure>" for t, svg in plots.draw(run)]
    )
    tb = run.tensorboard
    facts = [
        ("run folder", str(run.path.resolve())),
        ("framework", framework or "unknown"),
        ("steps", str(n_steps)),
        ("tensorboard", str(tb) if tb else "none (add tensorboard to trainer.logger)"),
        ("engine events", str(len(run.events))),
    ]
    if run.skipped:
        facts.append(("skipped records", str(run.skipped)))
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
