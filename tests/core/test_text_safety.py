"""Output hygiene: strings from outside (an engine's output, a peer's path or error line) reach
our logs and one-line errors with no terminal control or escape sequence left in them
(``modal_rl.text_safety.clean``), including OSC 52 clipboard writes."""

from __future__ import annotations

import http.server
import os
import re
import threading
from collections import deque

import pytest

from modal_rl.text_safety import clean, clean_bytes

ATTACKS = {
    "osc52-bel": "\x1b]52;c;ZWNobyBwd25lZA==\x07",
    "osc52-st": "\x1b]52;p;ZWNobyBwd25lZA==\x1b\\",
    "osc8-link": "\x1b]8;;https://evil.example\x1b\\click\x1b]8;;\x1b\\",
    "osc-title-unterminated": "\x1b]0;owned",
    "csi-clear": "\x1b[2J\x1b[H\x1b[31;1m",
    "csi-partial": "\x1b[38;5",
    "c1-csi": "\x9b31m\x9b2J",
    "c1-osc": "\x9d52;c;eA==\x9c",
    "dcs": "\x1bP1$r0m\x1b\\",
    "apc": "\x1b_payload\x1b\\",
    "two-byte": "\x1bc\x1b7\x1b8",
    "lone-esc": "\x1b",
    "bell-backspace": "\x07ok\x08\x08\x08NO",
    "carriage-return": "real line\rfake line",
    "nul-del": "a\x00b\x7fc",
    "bidi": "user\u202egnp.exe",
    "vt-ff": "a\x0bb\x0cc",
}
BAD = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_no_control_or_escape_survives(attack):
    text = f"peer path /x/{ATTACKS[attack]}/y"
    one = clean(text)
    assert not BAD.search(one) and "\n" not in one and "\t" not in one
    many = clean(text + "\nnext\tline", multiline=True)
    assert not BAD.search(many) and "next\tline" in many
    assert clean(one) == one and clean(many, multiline=True) == many  # idempotent
    assert "52;" not in one or attack == "csi-partial"  # no OSC payload left to a terminal


def test_printable_text_passes_unchanged():
    text = "vLLM 0.32: loaded model /models/Qwen-0.5B — 100% ✓ (κ=3) [tab]\there"
    assert clean(text, multiline=True) == text
    assert clean(text) == text.replace("\t", " ")
    assert clean_bytes("é\x1b[31m".encode() + b"\xff") == "é\ufffd"


def test_an_engines_output_in_its_failure_error_is_clean():
    from modal_rl.engines.pool import engine_failure

    message = engine_failure("vllm", 0, "exited " + ATTACKS["csi-clear"], list(ATTACKS.values()))
    assert not BAD.search(message.replace("\n", ""))
    assert message.count("\n") == len(ATTACKS)  # one line per tail line: none forged


def test_an_engines_relayed_output_is_clean(capsys):
    from modal_rl.cluster.redaction import Redactor
    from modal_rl.engines.pool_modal import relay

    read, write = os.pipe()
    payload = ("loading\n" + "".join(ATTACKS.values()) + "\ndone\n").encode()
    os.write(write, payload)
    os.close(write)
    tail: deque = deque(maxlen=50)
    with os.fdopen(read, "rb") as stream:
        relay(stream, Redactor(None, ("x" * 43,)), tail)
    out = capsys.readouterr().out
    assert "loading" in out and "done" in out
    assert not BAD.search(out.replace("\n", "")) and all(not BAD.search(line) for line in tail)


def test_a_frame_servers_refusal_line_is_clean_in_the_receivers_error():
    from modal_rl.weightsync.wire.auth import refusal

    line = (
        '{"error": "no ' + ATTACKS["osc52-bel"].replace("\x1b", "\\u001b").replace("\x07", "\\u0007") + '"}'
    ).encode()
    message = refusal(line + b"\n", "127.0.0.1:1")
    assert "refused this receiver" in message and not BAD.search(message)


def test_the_key_forwarders_log_of_a_peers_path_is_clean():
    from modal_rl.engines.key_forwarder import KeyForwarder
    from modal_rl.run_key import new_run_key

    logs: list[str] = []
    fwd = KeyForwarder(["http://127.0.0.1:9"], key=new_run_key(), log=logs.append)
    fwd._log(f"refused GET /v1/{ATTACKS['osc52-st']}{ATTACKS['carriage-return']}: the path is not normal")
    assert len(logs) == 1 and not BAD.search(logs[0]) and "refused GET /v1/" in logs[0]


def test_an_engines_error_answer_is_clean_in_the_push_error():
    from modal_rl.engines.vllm_push import EnginePushError, _post
    from modal_rl.run_key import new_run_key

    class Evil(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = ("bad " + "".join(ATTACKS.values())).encode()
            self.send_response(500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Evil)
    thread = threading.Thread(target=server.handle_request, daemon=True)
    thread.start()
    try:
        with pytest.raises(EnginePushError) as info:
            _post(f"http://127.0.0.1:{server.server_port}", "/pause", {}, 10.0, new_run_key())
    finally:
        thread.join(10)
        server.server_close()
    assert "HTTP 500: bad" in str(info.value) and not BAD.search(str(info.value))
