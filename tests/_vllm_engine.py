"""One keyed local vLLM engine (the in-place extension loaded) for a module's tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from modal_rl.engines.pool import get_engine_pool
from modal_rl.engines.vllm import local_vllm_spec
from modal_rl.run_key import RUN_KEY_ENV
from tests.weightsync_helpers import TEST_KEY


@contextmanager
def local_inplace_engine(model_dir: Path, name: str, log_dir: Path) -> Iterator[str]:
    """Start ``model_dir`` in a real local pool under the test key; yield its URL; stop it."""
    spec = local_vllm_spec(str(model_dir), dtype="bfloat16", max_model_len=128, name=name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(RUN_KEY_ENV, TEST_KEY)
        pool = get_engine_pool(spec, "local", log_dir=str(log_dir))
        (url,) = pool.start()
        try:
            yield url
        finally:
            pool.stop()
