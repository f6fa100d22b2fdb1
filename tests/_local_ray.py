"""An in-process Ray node for tests that drive verl's Ray actors directly."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def loopback_ray(tmp_path_factory, num_cpus: int, env_vars: dict[str, str]) -> Iterator:
    """``ray`` with a local node on 127.0.0.1 (auth off: loopback only), shut down at the end;
    skips the test when this process already runs Ray. Ray's session dir and its workers'
    temp files go to a run dir that is removed at the end (``modal_rl.run_temp``); pytest's
    own temp root is fixed first, so it stays where it was."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray

    from modal_rl.run_temp import process_temp

    if ray.is_initialized():
        pytest.skip("a Ray runtime is already initialized in this process")
    tmp_path_factory.getbasetemp()
    with process_temp():
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", **env_vars}},
            log_to_driver=False,
        )
        try:
            yield ray
        finally:
            ray.shutdown()
