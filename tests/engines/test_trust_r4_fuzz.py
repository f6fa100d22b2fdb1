"""Hypothesis fuzz of the parsers issue 50 added: the engine guard's route verdict and body
check, the adapter-name rule, and the output cleaner. None raises on any input, the body
check passes only what its rules allow, and cleaned text holds no control character."""

from __future__ import annotations

import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from modal_rl.engines import routes as engine_routes
from modal_rl.text_safety import clean

CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
TEXT = st.text(alphabet=st.characters(codec=None), max_size=200)


@settings(max_examples=300, deadline=None)
@given(TEXT, st.booleans())
def test_clean_leaves_no_control_and_is_idempotent(text, multiline):
    out = clean(text, multiline=multiline)
    assert not CONTROL.search(out.replace("\n", "").replace("\t", "") if multiline else out)
    assert clean(out, multiline=multiline) == out


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD"]), TEXT)
def test_verdict_is_total(method, path):
    assert engine_routes.verdict(method, path) in (
        engine_routes.OPEN,
        engine_routes.ALLOW,
        engine_routes.CHECK,
        engine_routes.REFUSE,
    )


@settings(max_examples=300, deadline=None)
# A lone surrogate reaches the engine as its surrogatepass bytes, never as an error here.
@given(st.binary(max_size=300) | TEXT.map(lambda s: s.encode("utf-8", "surrogatepass")))
def test_a_collective_rpc_body_passes_only_with_our_method(body):
    why = engine_routes.body_refusal("/collective_rpc", [], body)
    if why is None:
        method = json.loads(body)["method"]
        assert engine_routes.OUR_RPC.fullmatch(method)


@settings(max_examples=300, deadline=None)
@given(TEXT, TEXT)
def test_a_lora_load_passes_only_from_the_staging_directory(name, leaf):
    root = str(engine_routes.adapter_root())
    for path in (leaf, f"{root}/{leaf}"):
        body = json.dumps({"lora_name": name, "lora_path": path}).encode()
        if engine_routes.body_refusal("/v1/load_lora_adapter", [], body) is None:
            assert path.rpartition("/")[0] == root
            assert "/" not in leaf and ".." not in leaf and not leaf.startswith(".")
            assert "/" not in name and ".." not in name


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD"]), TEXT)
def test_sglang_verdict_is_total_and_opens_only_its_table(method, path):
    from modal_rl.engines import sglang_routes

    got = sglang_routes.verdict(method, path)
    assert got in (sglang_routes.OPEN, sglang_routes.ALLOW, sglang_routes.REFUSE)
    if got == sglang_routes.ALLOW and "/v1/responses/" not in path:
        assert (method, path) in sglang_routes.ALLOWED


@settings(max_examples=300, deadline=None)
@given(st.lists(TEXT, max_size=6))
def test_the_sglang_launch_check_is_total(argv):
    from modal_rl.engines import sglang_routes

    why = sglang_routes.refusal(argv)
    assert why is None or ("\n" not in why or any("\n" in a for a in argv))
