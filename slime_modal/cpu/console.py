"""The CPU main job's terminal: ``... | python -m slime_modal.cpu.console LOG`` writes every line
of the run to LOG and shows only a line per phase and per step on the terminal.

A phase line is one of the launcher's own (``slime_modal:``, ``[modal_rl.cluster ...]``), the
CPU boundary's one line (``[slime_modal.cpu]``, once), or a slime milestone in :data:`PHASES`;
a step line is our step numbers (``[modal_rl.step]``, ``slime_modal.step_metrics``), an engine
line our rollout manager's supervisor events (``[modal_rl.engine]``); a traceback's
last line and slime's errors are shown too, so a failure is visible without opening LOG.
"""

from __future__ import annotations

import re
import sys

PHASES = {
    "Creating placement group": "placement group (logical GPUs) ready",
    "Load checkpoint from HuggingFace": "Megatron loading the HF checkpoint",
    "Router launched at": "slime's router up",
    "The server is fired up and ready to roll": "SGLang engine serving (CPU)",
    "Pulling full checkpoint v0": "SGLang's local checkpoint made (the delta base)",
    "Timer update_weights end": "weights published to SGLang",
}
SHOWN = ("slime_modal:", "[modal_rl.cluster", "[modal_rl.step]", "[modal_rl.engine]", "[slime_modal.cpu]")
WIDTH = 240
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PREFIX = re.compile(r"^\((?:[A-Za-z_]+ )?pid=\d+(?:, ip=[^)]*)?\)\s*")


def shown(line: str, seen: set[str]) -> str | None:
    text = _PREFIX.sub("", _ANSI.sub("", line.rstrip("\n")))
    for mark in SHOWN:
        if text.startswith(mark) or mark in text[:60]:
            if mark == "[slime_modal.cpu]":
                if mark in seen:
                    return None
                seen.add(mark)
            shown_text = text[text.index(mark) :]
            # the launcher's job line repeats slime's whole command line, which LOG holds
            return shown_text if len(shown_text) <= WIDTH else shown_text[: WIDTH - 1] + "…"
    for needle, label in PHASES.items():
        if needle in text and label and needle not in seen:
            seen.add(needle)
            return f"[slime] {label}"
    if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", text):
        return text
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    seen: set[str] = set()
    with open(argv[0], "a", encoding="utf-8", errors="replace") as log:
        for line in sys.stdin:
            log.write(line)
            log.flush()
            out = shown(line, seen)
            if out is not None:
                print(out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
