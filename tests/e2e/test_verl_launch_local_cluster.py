"""A real verl 0.9.1 GRPO step on a 2-node local cluster brought up by ``modal_rl.cluster``
(``--backend local --nodes 2``: two Ray nodes on 127.0.0.2, one logical GPU each, verl's
driver submitted as the cluster's Ray job). Two FSDP2 ranks over Gloo across the nodes and a
vLLM server on each.

It takes ~6 min on the 2-core dev box, longer than the default suite's budget for one test,
so it runs only with ``VERL_MODAL_CLUSTER_RUN=1``.
"""

from __future__ import annotations

import math
import os

import pytest

from tests.e2e.test_verl_cpu_run import parse_metrics, run_launcher


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(
    os.environ.get("VERL_MODAL_CLUSTER_RUN") != "1", reason="~6 min; set VERL_MODAL_CLUSTER_RUN=1"
)
def test_one_grpo_step_on_two_local_nodes(tmp_path):
    code, log = run_launcher(
        ["--backend", "local", "--nodes", "2", "--tiny", str(tmp_path / "tiny"), "--"]
        + ["trainer.total_training_steps=1"],
        timeout=1700,
    )
    assert code == 0, log[-6000:]
    assert "[modal_rl.cluster rank 0] all 2 nodes joined" in log
    assert "-m verl_modal.launch --cpu -- " in log  # verl's driver ran as the cluster's job
    assert "trainer.nnodes=2" in log
    assert "[verl_modal] TaskRunner on verl platform 'cpu', node 127.0.0.2;" in log
    metrics = parse_metrics(log)
    assert list(metrics) == [1], log[-6000:]
    step = metrics[1]
    assert math.isfinite(float(step["actor/grad_norm"]))
    # vLLM starts from random weights: agreement with the actor means the sync landed.
    assert float(step["training/rollout_actor_probs_pearson_corr"]) > 0.9
    assert log.count("[verl_modal.cpu] vLLM layer-wise weight reload") >= 2
