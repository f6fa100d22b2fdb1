"""The one-pass diff kernel against the plain numpy diff it replaced."""

import numpy as np
import pytest

from modal_rl.weightsync.codec import diffwords
from modal_rl.weightsync.codec.diffwords import diff_words


def _reference(b, n):
    pos = np.flatnonzero(b != n)
    return pos, b[pos], n[pos]


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 4099])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.5, 1.0])
def test_matches_numpy(dtype, size, density):
    rng = np.random.default_rng(size)
    b = rng.integers(0, np.iinfo(dtype).max, size, dtype=dtype, endpoint=True)
    n = b.copy()
    hit = rng.random(size) < density
    n[hit] ^= dtype(1)
    got, want = diff_words(b, n), _reference(b, n)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and np.array_equal(g, w)
    assert got[0].size == int(hit.sum())


def test_the_last_word_and_the_tail_after_whole_blocks():
    b = np.zeros(11, np.uint16)  # two whole 64-bit blocks, then three words
    n = b.copy()
    n[[0, 7, 8, 10]] = [1, 2, 3, 4]
    pos, old, new = diff_words(b, n)
    assert pos.tolist() == [0, 7, 8, 10] and new.tolist() == [1, 2, 3, 4] and old.tolist() == [0] * 4


def test_strided_views_take_the_numpy_path():
    b = np.arange(64, dtype=np.uint16)
    n = b.copy()
    n[::5] += 1
    pos, old, new = diff_words(b[::2], n[::2])
    ref = _reference(b[::2], n[::2])
    assert all(np.array_equal(x, y) for x, y in zip((pos, old, new), ref, strict=True))


def test_numpy_path_when_numba_is_missing(monkeypatch):
    monkeypatch.setattr(diffwords.DIFF, "get", lambda: None)
    b = np.arange(1000, dtype=np.uint16)
    n = b.copy()
    n[[3, 500, 999]] += 7
    assert diff_words(b, n)[0].tolist() == [3, 500, 999]


def test_numba_is_loaded_on_the_first_kernel_use_not_at_import():
    import subprocess
    import sys

    code = (
        "import sys\nimport numpy as np\n"
        "from modal_rl.weightsync.codec import diffwords, scatter\n"
        "assert 'numba' not in sys.modules\n"
        "words = np.zeros(8, np.uint16)\n"
        "scatter.scatter(words, np.array([1, 3]), 0, np.array([5, 6], np.uint16), 'set')\n"
        "assert 'numba' in sys.modules and words.tolist() == [0, 5, 0, 6, 0, 0, 0, 0]\n"
        "assert diffwords.diff_words(words, np.zeros(8, np.uint16))[0].tolist() == [1, 3]\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
