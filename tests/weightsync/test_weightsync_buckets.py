"""The publisher's delta layout (``buckets``) against the per-tensor encoder it replaces:
byte-identical frames over several versions, receivers bit-exact, layout errors refused."""

import io

import numpy as np
import pytest
import torch

from modal_rl.weightsync.codec import fused, sum_lanes
from modal_rl.weightsync.codec.buckets import DeltaLayout
from modal_rl.weightsync.codec.decode import apply_frame
from modal_rl.weightsync.codec.encode import CodecConfig, encode_anchor, encode_delta
from modal_rl.weightsync.codec.held_layout import HeldLayout
from modal_rl.weightsync.errors import ChecksumMismatchError, LayoutMismatchError
from modal_rl.weightsync.shards import dim0_pieces
from modal_rl.weightsync.wire.frames import state_digest

pytestmark = pytest.mark.skipif(not fused.ready(), reason="the layout needs numba")


def _mixed(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {}
    for k in range(40):  # many small expert-like matrices (one group), odd sizes included
        state[f"e{k}.w"] = torch.randn(3 + k % 5, 7, generator=g).to(torch.bfloat16)
    state["big"] = torch.randn(5000, generator=g).to(torch.bfloat16)  # several chunks
    state["f32"] = torch.randn(33, 9, generator=g)
    state["steps"] = torch.arange(77, dtype=torch.int64)
    state["scalar"] = torch.tensor(1.5)
    state["empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    state["tail"] = torch.randn(1001, generator=g).to(torch.bfloat16)
    return state


def _step(state: dict[str, torch.Tensor], g: torch.Generator, density: float) -> None:
    for t in state.values():
        flat = t.view(-1)
        if not flat.numel():
            continue
        bits = flat.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
        hit = torch.rand(bits.numel(), generator=g) < density
        bits[hit] += torch.randint(1, 4, (int(hit.sum()),), generator=g, dtype=bits.dtype)


def _items(state, sharded: bool):
    return list(dim0_pieces(state.items(), 1, 3)) if sharded else list(state.items())


def _frame(records) -> bytes:
    return b"".join(records)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize(
    "coding,link", [(2, None), (2, 2e6), (1, None), (0, None)], ids=["v2", "v2-by-time", "v1", "dense"]
)
def test_frames_are_byte_identical_to_the_per_tensor_encoder(sharded, coding, link):
    config = CodecConfig(chunk_elems=1024, threads=2, coding=coding, link_bytes_per_s=link)
    trainer = _mixed(0)
    g = torch.Generator().manual_seed(7)
    first = dict(_items(trainer, sharded))
    old_base = {k: v.clone() for k, v in first.items()}
    new_base = {k: v.clone() for k, v in first.items()}
    sums: dict[str, str] = {}
    anchor = _frame(encode_anchor(first.items(), version=0, config=config, checksums_out=sums))
    held = apply_frame({}, io.BytesIO(anchor), held_version=None, config=config, key=None)
    state, held_sums = held.state, held.checksums
    # a second receiver keeps a ``HeldLayout``: the same results, bit for bit
    twin, twin_sums, twin_layout = {k: v.clone() for k, v in state.items()}, dict(held_sums), HeldLayout()
    layout = DeltaLayout.build(new_base, config.chunk_elems)
    assert layout is not None
    old_sums, new_sums = dict(sums), dict(sums)
    for version in range(1, 6):
        _step(trainer, g, 0.02 if version < 5 else 0.6)
        items = _items(trainer, sharded)
        old_out: dict[str, str] = {}
        new_out: dict[str, str] = {}
        kw = {"base_version": version - 1, "version": version, "config": config, "update_base": True}
        old = _frame(
            encode_delta(old_base, iter(items), base_checksums=old_sums, checksums_out=old_out, **kw)
        )
        new = _frame(layout.encode_delta(iter(items), base_checksums=new_sums, checksums_out=new_out, **kw))
        assert new == old, f"version {version}: frames differ"
        assert new_out == old_out
        old_sums, new_sums = old_out, new_out
        for name, tensor in items:  # the snapshot took the version
            assert torch.equal(
                new_base[name].view(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)
            )
        result = apply_frame(
            state,
            io.BytesIO(new),
            held_version=version - 1,
            held_checksums=held_sums,
            config=config,
            key=None,
        )
        held_sums = result.checksums
        fast = apply_frame(
            twin,
            io.BytesIO(new),
            held_version=version - 1,
            held_checksums=twin_sums,
            config=config,
            key=None,
            layout=twin_layout,
        )
        assert fast.checksums == result.checksums and fast.changed_words == result.changed_words
        twin_sums = dict(fast.checksums)  # as the chain keeps them: a copy
        for name, tensor in items:
            assert torch.equal(state[name].view(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))
            assert torch.equal(twin[name].view(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))
    assert twin_layout.groups and twin_layout.lanes is not None  # the layout was in use


def test_a_held_layout_refuses_a_delta_onto_a_damaged_word_and_rolls_back():
    config = CodecConfig(chunk_elems=1024, threads=2, coding=1)
    trainer = _mixed(3)
    g = torch.Generator().manual_seed(9)
    base = {k: v.clone() for k, v in trainer.items()}
    sums: dict[str, str] = {}
    anchor = _frame(encode_anchor(base.items(), version=0, config=config, checksums_out=sums))
    held = apply_frame({}, io.BytesIO(anchor), held_version=None, config=config, key=None)
    state, held_sums, layout = held.state, dict(held.checksums), HeldLayout()
    delta_layout = DeltaLayout.build(base, config.chunk_elems)
    for version in (1, 2):
        _step(trainer, g, 0.05)
        out: dict[str, str] = {}
        frame = _frame(
            delta_layout.encode_delta(
                trainer,
                base_version=version - 1,
                version=version,
                config=config,
                base_checksums=sums,
                checksums_out=out,
                update_base=True,
            )
        )
        sums = out
        if version == 2:  # held words the delta changes are damaged (its blocks' sums move wrong)
            state["big"].view(-1).view(torch.int16)[:] ^= 0x40
            before = {k: v.clone() for k, v in state.items()}
            with pytest.raises(ChecksumMismatchError):
                apply_frame(
                    state,
                    io.BytesIO(frame),
                    held_version=1,
                    held_checksums=held_sums,
                    config=config,
                    key=None,
                    layout=layout,
                )
            assert all(torch.equal(before[k], state[k]) for k in state)
            assert layout.lanes is None
            return
        result = apply_frame(
            state,
            io.BytesIO(frame),
            held_version=0,
            held_checksums=held_sums,
            config=config,
            key=None,
            layout=layout,
        )
        held_sums = dict(result.checksums)


def test_a_tensor_of_another_layout_is_refused_in_one_line():
    state = _mixed(1)
    base = {k: v.clone() for k, v in state.items()}
    sums: dict[str, str] = {}
    _frame(encode_anchor(base.items(), version=0, checksums_out=sums))
    layout = DeltaLayout.build(base, CodecConfig().chunk_elems)
    kw = {"base_version": 0, "version": 1, "config": CodecConfig(), "base_checksums": sums}
    wrong = dict(state, f32=torch.zeros(33, 8))
    with pytest.raises(LayoutMismatchError, match="'f32'.*float32\\[33, 9\\].*float32\\[33, 8\\]"):
        _frame(layout.encode_delta(wrong, **kw))
    renamed = [("other" if k == "steps" else k, v) for k, v in state.items()]
    with pytest.raises(LayoutMismatchError, match="'other' is not in the base"):
        _frame(layout.encode_delta(iter(renamed), **kw))
    with pytest.raises(LayoutMismatchError, match="lacks tensors of the base"):
        _frame(layout.encode_delta(iter(list(state.items())[:-1]), **kw))


def test_unaligned_and_strided_new_tensors_are_read_through_a_copy():
    state = {"a": torch.zeros(64, 8, dtype=torch.bfloat16), "b": torch.zeros(8, 64, dtype=torch.bfloat16)}
    base = {k: v.clone() for k, v in state.items()}
    sums: dict[str, str] = {}
    _frame(encode_anchor(base.items(), version=0, checksums_out=sums))
    layout = DeltaLayout.build(base, CodecConfig().chunk_elems)
    flat = torch.ones(64 * 8 + 1, dtype=torch.bfloat16)
    new = {"a": flat[1:].view(64, 8), "b": torch.ones(64, 8, dtype=torch.bfloat16).t()}
    out: dict[str, str] = {}
    kw = {"base_version": 0, "version": 1, "config": CodecConfig(coding=1)}
    _frame(layout.encode_delta(new, base_checksums=sums, checksums_out=out, update_base=True, **kw))
    assert all(torch.equal(base[k], new[k].contiguous()) for k in new)


def test_sum_lanes_digest_and_hex_match_the_wire_functions():
    rng = np.random.default_rng(0)
    names = [f"t{k}.w" for k in rng.permutation(300)] + ["é", "a\x01"]
    a = rng.integers(0, 2**64, len(names), dtype=np.uint64, endpoint=False)
    c = rng.integers(0, 2**64, len(names), dtype=np.uint64, endpoint=False)
    hexes = sum_lanes.to_hex(a, c)
    assert hexes[0] == f"{int(a[0]):016x}{int(c[0]):016x}"
    back = sum_lanes.from_hex(hexes)
    assert np.array_equal(back[0], a) and np.array_equal(back[1], c)
    assert sum_lanes.SortedDigest(names).digest(a, c) == state_digest(dict(zip(names, hexes, strict=True)))


def test_a_chain_keeps_its_layout_across_deltas_and_forgets_it_at_an_anchor():
    import gc
    import weakref

    from modal_rl.weightsync.chain import VersionChain

    config = CodecConfig(chunk_elems=1024, threads=1, coding=1)
    trainer = _mixed(4)
    g = torch.Generator().manual_seed(2)
    chain = VersionChain(config, retain=False, key=None)
    base = {k: v.clone() for k, v in trainer.items()}
    sums: dict[str, str] = {}
    chain.apply(_frame(encode_anchor(base.items(), version=0, config=config, checksums_out=sums)))
    for version in (1, 2):
        _step(trainer, g, 0.05)
        out: dict[str, str] = {}
        kw = {"base_version": version - 1, "version": version, "config": config, "update_base": True}
        chain.apply(_frame(encode_delta(base, trainer, base_checksums=sums, checksums_out=out, **kw)))
        sums = out
    assert chain._layout.groups and chain._layout.lanes is not None
    old = weakref.ref(chain.state["big"])
    # An anchor writes a held tensor of the same shape in place (``anchor_inplace``); one that
    # reshapes "big" decodes it fresh, and the tensor it replaces must not outlive the anchor.
    trainer["big"] = trainer["big"].reshape(50, 100).clone()
    chain.apply(_frame(encode_anchor(trainer.items(), version=3, config=config)))
    assert not chain._layout.groups and chain._layout.lanes is None
    gc.collect()
    assert old() is None  # the replaced state is not kept alive by the layout
    for name, tensor in trainer.items():
        assert torch.equal(chain.state[name].view(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


def test_a_snapshot_that_is_not_contiguous_host_memory_gets_no_layout():
    strided = {"a": torch.zeros(8, 16, dtype=torch.bfloat16).t(), "b": torch.zeros(4)}
    assert DeltaLayout.build(strided, CodecConfig().chunk_elems) is None
    assert DeltaLayout.build({}, CodecConfig().chunk_elems) is None
    assert DeltaLayout.build({"b": torch.zeros(4)}, CodecConfig().chunk_elems) is not None


def test_the_layout_codes_v1_when_the_link_rate_is_unknown(monkeypatch):
    # v2 reads every word of a chunk and pays only on a slow link: without a rate, the laid-out
    # encoder never runs it (as the per-tensor encoder)
    import modal_rl.weightsync.codec.buckets as buckets

    def no_v2(*args, **kwargs):
        raise AssertionError("v2 coded without a known link rate")

    monkeypatch.setattr(buckets, "pick_by_time", no_v2)
    config = CodecConfig(chunk_elems=1024, threads=1, coding=2, link_bytes_per_s=None)
    trainer = _mixed(5)
    base = {k: v.clone() for k, v in trainer.items()}
    layout = DeltaLayout.build(base, config.chunk_elems)
    sums: dict[str, str] = {}
    _frame(encode_anchor(trainer.items(), version=0, config=config, checksums_out=sums))
    _step(trainer, torch.Generator().manual_seed(3), 0.05)
    kw = {"base_version": 0, "version": 1, "config": config, "update_base": True}
    frame = _frame(layout.encode_delta(iter(trainer.items()), base_checksums=sums, **kw))
    assert frame
