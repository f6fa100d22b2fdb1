"""An exec's ``stdout_limit_bytes`` / ``stderr_tail_bytes`` hold where the bytes are read: the
local agent in the sandbox (real bubblewrap) and the Modal provider's stream reads (a fake
stream: the only fake here), and leave every other caller's output as it was."""

from __future__ import annotations

import asyncio

import pytest

from modal_rl.sandboxes import LocalProvider, SandboxPool, SandboxSpec
from modal_rl.sandboxes.modal_provider import _read_head, _read_tail
from tests._sandboxes_helpers import needs_bwrap, no_processes_left

WRITES = "import sys\nsys.stdout.write('a' * 5000 + 'b' * 5000)\nsys.stderr.write('x' * 5000 + 'tail')\n"


@needs_bwrap
def test_local_exec_keeps_the_head_of_stdout_and_the_tail_of_stderr():
    async def main():
        pool = SandboxPool(
            LocalProvider(),
            SandboxSpec(timeout_s=60),
            min_warm=1,
            max_live=1,
            name="bounds",
            rate_limiter=False,
        )
        await pool.start()
        try:
            async with pool.lease(reuse=True) as sb:
                argv = ["python3", "-c", WRITES]
                bounded = await sb.exec(argv, timeout_s=10, stdout_limit_bytes=6000, stderr_tail_bytes=10)
                exact = await sb.exec(argv, timeout_s=10, stdout_limit_bytes=10000, stderr_tail_bytes=0)
                plain = await sb.exec(argv, timeout_s=10)
                with pytest.raises(ValueError, match="stdout_limit_bytes"):
                    await sb.exec(argv, timeout_s=10, stdout_limit_bytes=-1)
            return bounded, exact, plain
        finally:
            await pool.close()

    bounded, exact, plain = asyncio.run(main())
    no_processes_left()
    assert bounded.stdout == "a" * 5000 + "b" * 1000 and bounded.stdout_truncated
    assert bounded.stderr == "x" * 6 + "tail" and bounded.ok
    assert len(exact.stdout) == 10000 and not exact.stdout_truncated and exact.stderr == ""
    assert len(plain.stdout) == 10000 and plain.stderr == "x" * 5000 + "tail" and not plain.stdout_truncated


class _Stream:
    """Modal's exec stream, as the provider reads it: ``read.aio()``, async iteration, ``aclose``."""

    def __init__(self, chunks):
        self.chunks, self.served, self.closed = chunks, 0, False
        outer = self

        class _Read:
            async def aio(self):
                return b"".join(outer.chunks)

        class _Close:
            async def aio(self):
                outer.closed = True

        self.read, self.aclose = _Read(), _Close()

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for chunk in self.chunks:
            self.served += 1
            yield chunk


def test_modal_reads_stop_at_the_budget_and_keep_a_tail():
    async def main():
        many = _Stream([b"x" * 1000] * 100)
        head = await _read_head(many, 2500)
        assert head == (b"x" * 2500, True) and many.closed and many.served == 3  # the rest never fetched
        assert await _read_head(_Stream([b"ab", b"cd"]), 4) == (b"abcd", False)
        assert await _read_head(_Stream([b"ab", b"cd"]), None) == (b"abcd", False)
        assert await _read_tail(_Stream([b"0123456789"] * 50 + [b"end"]), 5) == b"89end"
        assert await _read_tail(_Stream([b"ab"]), None) == b"ab"

    asyncio.run(main())
