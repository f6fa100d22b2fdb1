"""One compiled pass per delta chunk on the publisher: compare, emit, write back, move sums.

A chunk of a group's word space is a run of *pieces* (a tensor's words, or part of one).
``diff_chunk`` hands the compiled kernel every piece's base and new word addresses at once,
so the kernel walks the pieces itself: no Python per piece. In that one pass it

- tests 64 bytes of base against new at a time (one branch per group; a loop LLVM
  vectorizes), and inside a changed group only its changed 8-byte blocks;
- writes each changed word's chunk-local position, old word and new word (sorted, exactly
  what ``diffwords.diff_words`` over the joined pieces gives);
- with ``write``, copies a changed block's new words into the base (the publisher's
  snapshot takes the version: only changed blocks are written);
- moves each piece's ls128 sum (``linsum``) by the changed blocks, whose old and new values
  are in registers there: no second read of any block.

Invariants: positions, words and moves equal ``diff_words`` + ``linsum.delta_sum`` of the
same pieces (tested against them); every piece must start at an 8-byte block of its tensor
(chunks hold a multiple of 8 words and a group holding several tensors is one chunk, so the
encoder's pieces do) and be a contiguous host array at an 8-byte aligned address; ``diff_chunk`` returns None where numba
is missing or a piece does not qualify, and the caller takes the per-piece numpy path.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from modal_rl.weightsync.codec import linsum
from modal_rl.weightsync.codec.jit import Kernel
from modal_rl.weightsync.codec.linsum import P1, P2, S1, S2

GROUP_BLOCKS = 8  # 8-byte blocks tested together: 64 bytes, one branch


def _block_value(w, lo, hi, shift):
    """Words ``w[lo:hi]`` as one little-endian 8-byte block (zero past ``hi``)."""
    v = np.uint64(0)
    for j in range(lo, hi):
        v |= np.uint64(w[j]) << np.uint64((j - lo) * shift)
    return v


def _fused_kernel(addr_b, addr_n, counts, first_blocks, starts, per, write, pos, old, new, move_a, move_c):
    """See the module docstring. ``old``/``new`` (sized for the whole chunk) give the word
    type, ``move_a`` the 8-byte block type; returns how many words changed."""
    k = 0
    shift = 64 // per
    for p in range(counts.size):
        n_words = counts[p]
        nblk = n_words // per  # whole 8-byte blocks
        b = _carray(_ptr(addr_b[p], old), n_words)
        n = _carray(_ptr(addr_n[p], old), n_words)
        b64 = _carray(_ptr(addr_b[p], move_a), nblk)
        n64 = _carray(_ptr(addr_n[p], move_a), nblk)
        s = starts[p]
        first = first_blocks[p]
        a = np.uint64(0)
        c = np.uint64(0)
        whole = nblk - nblk % GROUP_BLOCKS
        for g in range(0, whole, GROUP_BLOCKS):
            acc = np.uint64(0)
            for t in range(GROUP_BLOCKS):
                acc |= b64[g + t] ^ n64[g + t]
            if acc:
                for t in range(GROUP_BLOCKS):
                    x = b64[g + t]
                    y = n64[g + t]
                    if x != y:
                        bb = np.uint64(first + g + t)
                        a += _m1(y ^ (bb * P1 + S1)) - _m1(x ^ (bb * P1 + S1))
                        c += _m2(y + ((bb * P2) ^ S2)) - _m2(x + ((bb * P2) ^ S2))
                        # a changed block's words, written always and kept when they differ:
                        # no branch to mispredict (k <= j, so writes stay inside the buffers)
                        for j in range((g + t) * per, (g + t + 1) * per):
                            u = b[j]
                            v = n[j]
                            pos[k] = s + j
                            old[k] = u
                            new[k] = v
                            k += u != v
                        if write:
                            b64[g + t] = y
        for blk in range(whole, -(-n_words // per)):  # the blocks after the last whole group
            lo = blk * per
            hi = min(lo + per, n_words)
            x = _blockv(b, lo, hi, shift)
            y = _blockv(n, lo, hi, shift)
            if x != y:
                bb = np.uint64(first + blk)
                a += _m1(y ^ (bb * P1 + S1)) - _m1(x ^ (bb * P1 + S1))
                c += _m2(y + ((bb * P2) ^ S2)) - _m2(x + ((bb * P2) ^ S2))
                for j in range(lo, hi):
                    u = b[j]
                    v = n[j]
                    if u != v:
                        pos[k] = s + j
                        old[k] = u
                        new[k] = v
                        k += 1
                        if write:
                            b[j] = v
        move_a[p] = a
        move_c[p] = c
    return k


def _write_kernel(addr_b, counts, starts, positions, words):
    """``base[p][positions - starts[p]] = words`` piece by piece (positions sorted, chunk-local)."""
    i = 0
    for p in range(counts.size):
        b = _carray(_ptr(addr_b[p], words), counts[p])
        end = starts[p] + counts[p]
        while i < positions.size and positions[i] < end:
            b[positions[i] - starts[p]] = words[i]
            i += 1
    return i


def _apply_kernel(addrs, counts, offsets, per, positions, values, xor, move_a, move_c):
    """A receiver's sparse chunk in one pass: ``words[p][positions - offsets[p]] ^= values``
    (``xor``) or ``+= values`` segment by segment, each changed block's sum move taken from
    its value before and after (``linsum``). ``values`` give the word type; positions sorted,
    chunk-local; returns how many were applied (all of them, unless one lies past the last
    segment)."""
    i = 0
    n = positions.size
    shift = 64 // per
    for p in range(counts.size):
        size = counts[p]
        w = _carray(_ptr(addrs[p], values), size)
        off = offsets[p]
        a = np.uint64(0)
        c = np.uint64(0)
        while i < n and positions[i] - off < size:
            blk = (positions[i] - off) // per
            lo = blk * per
            hi = min(lo + per, size)
            x = _blockv(w, lo, hi, shift)
            while i < n and positions[i] - off < hi:
                j = positions[i] - off
                if xor:
                    w[j] ^= values[i]
                else:
                    w[j] += values[i]
                i += 1
            y = _blockv(w, lo, hi, shift)
            bb = np.uint64(blk)
            a += _m1(y ^ (bb * P1 + S1)) - _m1(x ^ (bb * P1 + S1))
            c += _m2(y + ((bb * P2) ^ S2)) - _m2(x + ((bb * P2) ^ S2))
        move_a[p] = a
        move_c[p] = c
    return i


def _gather_kernel(addr, counts, starts, out):
    """``out[starts[p] : starts[p] + counts[p]]`` = the words at ``addr[p]``, piece by piece."""
    for p in range(counts.size):
        src = _carray(_ptr(addr[p], out), counts[p])
        out[starts[p] : starts[p] + counts[p]] = src


_m1 = _m2 = _ptr = _carray = _blockv = None  # bound before the kernel is first compiled (``_bind``)
FUSED, WRITE, APPLY = Kernel(_fused_kernel), Kernel(_write_kernel), Kernel(_apply_kernel)
GATHER = Kernel(_gather_kernel)


def _bind() -> bool:
    """Bind the kernel's helpers (linsum's mixers, an address-to-pointer cast); False without numba."""
    global _m1, _m2, _ptr, _carray, _blockv
    if _ptr is not None:
        return True
    if linsum._compiled() is None:
        return False
    from numba import carray, njit, types
    from numba.extending import intrinsic

    @intrinsic
    def address_as_pointer(typingctx, address, like):
        """The word pointer at integer ``address``, typed by the array ``like``."""
        ptr_type = types.CPointer(like.dtype)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(ptr_type))

        return ptr_type(address, like), codegen

    _m1, _m2, _ptr, _carray = linsum._m1, linsum._m2, address_as_pointer, carray
    _blockv = njit(nogil=True, cache=True, inline="always")(_block_value)
    return True


_local = threading.local()


def _scratch(total: int, word: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This thread's emit buffers for a chunk of ``total`` words (kept between chunks: a
    fresh mapping per chunk cost a third of the pass; only the pages a chunk's changes
    reach are ever touched)."""
    held = getattr(_local, "buffers", None)
    if held is None or held[0].size < total or held[1].dtype != word:
        held = (np.empty(total, np.int64), np.empty(total, word), np.empty(total, word))
        _local.buffers = held
    return held[0][:total], held[1][:total], held[2][:total]


def _address(words: np.ndarray) -> int:
    return words.__array_interface__["data"][0]


def diff_chunk(pieces: list[tuple[np.ndarray, np.ndarray, int, int, int]], total: int, write: bool):
    """``pieces``: (base words, new words, first word in them, count, chunk-local start), in
    chunk order; ``total``: the chunk's word count. Returns (positions, old, new, move_a,
    move_c): the chunk's changes and each piece's sum move as its two uint64 lanes — or None
    (no numba, or a piece that does not qualify: the caller's numpy path runs)."""
    if not pieces or not _bind():
        return None
    word = pieces[0][1].dtype
    per = max(1, 8 // word.itemsize)
    addr_b, addr_n, counts, firsts, starts = [], [], [], [], []
    for base, new, at, count, start in pieces:
        if (
            at % per
            or base.dtype != word
            or new.dtype != word
            or not (base.flags.c_contiguous and new.flags.c_contiguous and base.flags.writeable)
            or base.size < at + count
            or new.size < at + count
            or _address(base) % 8
            or _address(new) % 8
        ):
            return None
        addr_b.append(_address(base) + at * word.itemsize)
        addr_n.append(_address(new) + at * word.itemsize)
        counts.append(count)
        firsts.append(at // per)
        starts.append(start)
    kernel = FUSED.get()
    if kernel is None:
        return None
    pos, old, new_words = _scratch(total, word)
    move_a, move_c = np.empty(len(pieces), np.uint64), np.empty(len(pieces), np.uint64)
    keep = (pieces,)  # the pieces' arrays stay alive while the kernel reads their addresses
    k = kernel(
        np.array(addr_b, np.int64),
        np.array(addr_n, np.int64),
        np.array(counts, np.int64),
        np.array(firsts, np.int64),
        np.array(starts, np.int64),
        per,
        write,
        pos,
        old,
        new_words,
        move_a,
        move_c,
    )
    del keep
    return pos[:k].copy(), old[:k].copy(), new_words[:k].copy(), move_a, move_c


def diff_table(table, word: np.dtype, total: int, write: bool):
    """``diff_chunk`` over a chunk already laid out as address tables (``buckets``): ``table``
    is (base addresses, new addresses, counts, first blocks, chunk-local starts), int64
    arrays that satisfy ``diff_chunk``'s conditions (its caller checked them once). The
    memory behind the addresses must stay alive for the call."""
    per = max(1, 8 // word.itemsize)
    pos, old, new_words = _scratch(total, word)
    move_a, move_c = np.empty(table[2].size, np.uint64), np.empty(table[2].size, np.uint64)
    k = FUSED.get()(*table, per, write, pos, old, new_words, move_a, move_c)
    return pos[:k].copy(), old[:k].copy(), new_words[:k].copy(), move_a, move_c


def write_table(addr_b: np.ndarray, counts: np.ndarray, starts: np.ndarray, positions, words) -> None:
    """``write_changed`` with the pieces as address tables (see ``diff_table``)."""
    done = WRITE.get()(addr_b, counts, starts, positions, words)
    if done != positions.size:
        raise AssertionError(f"{positions.size - done} changes lie outside the chunk's pieces")


def gather_table(addr: np.ndarray, counts: np.ndarray, starts: np.ndarray, out: np.ndarray) -> None:
    """The pieces at ``addr`` copied into ``out`` at chunk-local ``starts`` (one compiled pass)."""
    GATHER.get()(addr, counts, starts, out)


def apply_table(table, lo: int, positions: np.ndarray, values: np.ndarray, xor: bool):
    """``apply_sparse`` with a group's segments as tables (``held_layout``): (addresses,
    sizes, group-local offsets, word type). Returns (first segment index, move lane a, move
    lane c) for the segments from it on that the chunk reaches, or None where it does not
    apply (values of another word type, a position past the last segment: the caller's
    checked path runs and refuses it)."""
    addrs, sizes, offsets, word = table
    if positions.size == 0 or values.dtype != word or not _bind():
        return None
    first, last = lo + int(positions[0]), lo + int(positions[-1])
    k0 = int(np.searchsorted(offsets, first, "right")) - 1
    k1 = int(np.searchsorted(offsets, last, "right"))
    if k0 < 0 or first < 0 or last >= int(offsets[k1 - 1] + sizes[k1 - 1]):
        return None
    per = max(1, 8 // word.itemsize)
    move_a, move_c = np.empty(k1 - k0, np.uint64), np.empty(k1 - k0, np.uint64)
    done = APPLY.get()(
        addrs[k0:k1], sizes[k0:k1], offsets[k0:k1] - lo, per, positions, values, xor, move_a, move_c
    )
    if done != positions.size:  # unreachable: the last position was checked above
        raise IndexError(f"{positions.size - done} changes lie past the chunk's tensors")
    return k0, move_a, move_c


def ready() -> bool:
    """Whether the compiled kernels are there (numba installed)."""
    return _bind() and FUSED.get() is not None


def write_changed(pieces: list[tuple[np.ndarray, np.ndarray, int, int, int]], positions, words) -> None:
    """Write a chunk's changed ``words`` at chunk-local ``positions`` into its pieces' base
    words (the pieces ``diff_chunk`` took, unchanged since, so they qualify)."""
    _bind()
    item = words.dtype.itemsize
    addr_b = np.array([_address(b) + at * item for b, _, at, _, _ in pieces], np.int64)
    counts = np.array([c for *_, c, _ in pieces], np.int64)
    starts = np.array([s for *_, s in pieces], np.int64)
    keep = (pieces,)
    done = WRITE.get()(addr_b, counts, starts, positions, words)
    del keep
    if done != positions.size:
        raise AssertionError(f"{positions.size - done} changes lie outside the chunk's pieces")


def apply_sparse(segments, lo: int, positions: np.ndarray, values: np.ndarray, xor: bool):
    """Apply a sparse chunk (chunk-local sorted ``positions``, residual ``values``; the chunk
    starts at word ``lo`` of the group) to host ``segments`` — (offset in the group's word
    space, the tensor's flat words) — and return (segment index, sum move) for each segment
    it changed; None where it does not apply (no numba, a segment that is not contiguous
    host words of the values' type, or a position past the last segment): the caller's
    per-segment path runs then."""
    if not _bind() or positions.size == 0:
        return None
    end = lo + int(positions[-1]) + 1
    picked = []
    for k, (start, words) in enumerate(segments):
        if start + _size(words) <= lo + int(positions[0]) or start >= end:
            continue
        if not isinstance(words, np.ndarray) or words.dtype != values.dtype or not words.flags.c_contiguous:
            return None
        picked.append((k, start - lo, words))
    kernel = APPLY.get()
    if kernel is None or not picked or int(positions[-1]) >= picked[-1][1] + picked[-1][2].size:
        return None  # (past the last tensor: the per-segment path refuses it before writing)
    per = max(1, 8 // values.dtype.itemsize)
    move_a, move_c = np.empty(len(picked), np.uint64), np.empty(len(picked), np.uint64)
    done = kernel(
        np.array([_address(w) for _, _, w in picked], np.int64),
        np.array([w.size for _, _, w in picked], np.int64),
        np.array([off for _, off, _ in picked], np.int64),
        per,
        positions,
        values,
        xor,
        move_a,
        move_c,
    )
    if done != positions.size:  # unreachable: the last position was checked above
        raise IndexError(f"{positions.size - done} changes lie past the chunk's tensors")
    return [(k, lanes_hex(a, c)) for (k, _, _), a, c in zip(picked, move_a, move_c, strict=True) if a or c]


def _size(words: Any) -> int:
    return int(words.size) if isinstance(words, np.ndarray) else int(words.numel())


def lanes_hex(a: Any, c: Any) -> str:
    """A sum move's two lanes as ``linsum``'s hex."""
    return f"{int(a):016x}{int(c):016x}"
