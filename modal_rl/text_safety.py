"""Strings from outside, made safe to print: no terminal control or escape sequence survives.

A peer's path, an engine's output line, a peer name or a sample's text can carry bytes that a
terminal executes: ESC sequences (CSI cursor moves and colours, OSC 52 clipboard writes, OSC 8
links, DCS/APC/PM/SOS strings), single-byte C1 controls (U+0080-U+009F, e.g. U+009B as a CSI
introducer), backspace and carriage return (which overwrite what a log line said), and Unicode
bidi controls (which reorder what a reader sees). ``clean`` removes whole sequences and
replaces every other control with ``?``, so what is left is printable text that reads as it
will be shown.

Invariants: ``clean(s)`` contains no C0 control (tab and newline kept only with
``multiline=True``; a carriage return becomes a newline there), no DEL, no C1 control and no bidi control; it is idempotent; printable
text passes unchanged.
"""

from __future__ import annotations

import re

# ESC followed by: a CSI (parameters, intermediates, a final byte); an OSC/DCS/APC/PM/SOS string
# up to its terminator (BEL or ESC \), a newline or the end (once its introducer is gone the rest
# is plain text); or any one other byte (two-byte escapes).
_ESCAPE = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]?"
    r"|\x1b[\]PX^_][^\x07\x1b\x9c\n]*(?:\x07|\x1b\\|\x9c)?"
    r"|\x9b[0-?]*[ -/]*[@-~]?"
    r"|[\x9d\x90\x98\x9e\x9f][^\x07\x1b\x9c\n]*(?:\x07|\x1b\\|\x9c)?"
    r"|\x1b[^\n]?",
)
_BIDI = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
_CONTROL = re.compile(f"[\\x00-\\x08\\x0a-\\x1f\\x7f-\\x9f{_BIDI}]")
_CONTROL_MULTILINE = re.compile(f"[\\x00-\\x08\\x0b-\\x1f\\x7f-\\x9f{_BIDI}]")
_TAB = re.compile("\t")
_CR = re.compile("\r\n?")


def clean(text: object, *, multiline: bool = False) -> str:
    """``text`` (any object: its ``str``) without escape sequences or controls. One line
    unless ``multiline`` (then tab and newline stay)."""
    out = _ESCAPE.sub("", str(text))
    if multiline:  # a carriage return would let a line overwrite what the log showed
        return _CONTROL_MULTILINE.sub("?", _CR.sub("\n", out))
    return _CONTROL.sub("?", _TAB.sub(" ", out))


def clean_bytes(data: bytes, *, multiline: bool = False) -> str:
    """``clean`` of bytes from outside, decoded as UTF-8 with bad bytes replaced."""
    return clean(data.decode("utf-8", "replace"), multiline=multiline)
