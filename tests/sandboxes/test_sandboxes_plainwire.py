"""The bounded decoders every byte from a sandbox goes through: ``_plainwire.decode`` (the
program's answers, in the runner) and ``testrun.parse_report`` (the runner's report, on the
host). Property and fuzz tests: any input either decodes or is refused with the decoder's own
error, never raises anything else, and costs O(input)."""

from __future__ import annotations

import contextlib
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modal_rl.sandboxes import _plainwire as wire
from modal_rl.sandboxes import testrun

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
leaves = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text() | st.binary()
hashable = st.recursive(
    leaves, lambda inner: st.tuples(inner, inner) | st.frozensets(inner, max_size=4), max_leaves=8
)
values = st.recursive(
    leaves | st.complex_numbers(allow_nan=False),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.tuples(inner, inner)
        | st.sets(hashable, max_size=5)
        | st.dictionaries(hashable, inner, max_size=5)
    ),
    max_leaves=30,
)


@FUZZ
@given(values)
def test_plain_values_round_trip_exactly(value):
    back = wire.decode(wire.encode(value))
    assert back == value and type(back) is type(value)


@FUZZ
@given(st.binary(max_size=2000))
def test_random_bytes_decode_or_are_refused(data):
    with contextlib.suppress(wire.ValueWireError):
        wire.decode(data)


@FUZZ
@given(values, st.data())
def test_damaged_messages_decode_or_are_refused(value, data):
    raw = bytearray(wire.encode(value))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    for candidate in (bytes(raw), bytes(raw[:cut])):
        with contextlib.suppress(wire.ValueWireError):
            wire.decode(candidate)


@pytest.mark.parametrize(
    "data",
    [
        b"l" + (1 << 31).to_bytes(4, "big"),  # a count far past the input
        b"s" + (10**9).to_bytes(4, "big") + b"x",
        b"l\x00\x00\x00\x01" * 100_000 + b"N",  # nested deeper than MAX_DEPTH
        b"i\x00\x00\x00\x05-12",  # an int's bytes past the end
        b"x\x07Counter\x00\x00\x00\x01N",  # a Counter with an odd item list
        b"x\x04nope\x00\x00\x00\x00",  # an unknown stdlib kind
        b"x\x12defaultdict:object\x00\x00\x00\x00",  # a factory not on the list
        b"x\x08Fraction\x00\x00\x00\x02i\x00\x00\x00\x01\x01i\x00\x00\x00\x01\x00",  # 1/0
        b"o\x04Evil\x00\x00\x00\x00\x00\x00\x00\x00",  # an object of a class the receiver lacks
        b"r\x00\x00\x00\x01",  # a back-reference to nothing
        b"NN",  # bytes after the value
        b"S\x00\x00\x00\x02l\x00\x00\x00\x00N",  # an unhashable set member
        b"?",
    ],
)
def test_adversarial_messages_are_refused(data):
    with pytest.raises(wire.ValueWireError):
        wire.decode(data)


def test_values_built_to_collide_in_a_hash_are_refused_at_once():
    colliding = [k * (2**61 - 1) for k in range(1, 60_000)]  # all hash to 0 in CPython
    # The set and dict messages are written from the list's bytes (a set's body is its members
    # in a list's layout, a dict's its keys and values in turn): building the Python set here
    # would itself take the quadratic time the decoder must not (~80 s).
    data = b"S" + wire.encode(colliding)[1:]
    t = time.monotonic()
    with pytest.raises(wire.ValueWireError, match="colliding"):
        wire.decode(data)
    assert time.monotonic() - t < 0.5  # refused after MAX_SAME_HASH, not built in O(n^2)
    pairs = [x for k in colliding for x in (k, 0)]
    with pytest.raises(wire.ValueWireError, match="colliding"):
        wire.decode(b"d" + wire._LEN.pack(len(colliding)) + wire.encode(pairs)[5:])
    few = colliding[:3]  # the same layouts, not colliding enough: decoded as a set and a dict
    assert wire.decode(b"S" + wire.encode(few)[1:]) == set(few)
    assert wire.decode(
        b"d" + wire._LEN.pack(3) + wire.encode([x for k in few for x in (k, 0)])[5:]
    ) == dict.fromkeys(few, 0)


def test_objects_travel_as_references_and_subclasses_are_not_plain():
    class Int(int):
        pass

    seen = []
    data = wire.encode([1, Int(2), object()], lambda v: seen.append(v) or wire.Ref(len(seen), "obj:x"))
    back = wire.decode(data)
    assert back[0] == 1 and [type(b) for b in back[1:]] == [wire.Ref, wire.Ref]
    assert [b.num for b in back[1:]] == [1, 2] and type(seen[0]) is Int and back[1].kind == "obj:x"
    with pytest.raises(wire.ValueWireError, match="cannot be sent"):
        wire.encode(Int(2))
    deep = []
    for _ in range(wire.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(wire.ValueWireError, match="too deeply"):
        wire.decode(wire.encode(deep))


def test_decoding_cost_is_linear_in_the_input():
    small, big = wire.encode(list(range(10_000))), wire.encode(list(range(100_000)))
    t = time.monotonic()
    wire.decode(small)
    t_small = time.monotonic() - t
    t = time.monotonic()
    wire.decode(big)
    t_big = time.monotonic() - t
    assert t_big < 30 * max(t_small, 1e-4)  # ten times the input: about ten times the time


REPORT = "MODAL_RL_UNIT\t1\tline 1: assert f(1) == 2\t\nMODAL_RL_UNIT\t0\tline 2\tAssertionError\nMODAL_RL_DONE\t2\n"


def test_a_report_is_read_and_anything_malformed_is_a_failed_run():
    report = testrun.parse_report("noise\n" + REPORT)
    assert report.complete and report.units == [
        ("line 1: assert f(1) == 2", True, ""),
        ("line 2", False, "AssertionError"),
    ]
    for bad in (
        REPORT.replace("DONE\t2", "DONE\t3"),
        REPORT.replace("UNIT\t1", "UNIT\t2"),
        REPORT.replace("MODAL_RL_DONE\t2\n", ""),
        "MODAL_RL_UNIT\t1\n" + REPORT,
        "[" * 200_000 + "\n" + REPORT.replace("DONE\t2", "DONE\t" + "9" * 5000),
    ):
        assert not testrun.parse_report(bad).complete
    with pytest.raises(testrun.InfraUnavailable):
        testrun.parse_report("MODAL_RL_INFRA\tno pytest here\n")


@FUZZ
@given(st.text(alphabet=st.sampled_from(list("MODAL_RLUNITDONE\t\n01[]{}x ")), max_size=3000))
def test_random_reports_parse_or_fail_cleanly(text):
    try:
        report = testrun.parse_report(text)
    except testrun.InfraUnavailable:
        return
    assert report.complete in (True, False) and len(report.units) <= testrun.MAX_UNITS


def test_a_flood_of_units_past_the_bound_is_a_failed_run():
    lines = "MODAL_RL_UNIT\t1\tx\t\n" * (testrun.MAX_UNITS + 1)
    t = time.monotonic()
    assert not testrun.parse_report(lines + f"MODAL_RL_DONE\t{testrun.MAX_UNITS + 1}\n").complete
    assert time.monotonic() - t < 1.0
