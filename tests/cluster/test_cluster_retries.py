"""``--retries``: a run whose node dies is brought back and resumes from its last checkpoint.

The local backend does what Modal's function retries do (a fresh cluster, the same job), so
it is tested here for real: chaos scenario (d), a 2-node local cluster whose follower is
SIGKILLed mid-job (see ``benchmarks/chaos_cluster.py``)."""

from __future__ import annotations

import pytest

from modal_rl.cluster.plan import EXIT_FOLLOWER_LOST, EXIT_HEAD_FAILED, EXIT_JOB_TIMEOUT
from modal_rl.cluster.retries import NodeLostError, RetryLog, raise_for_retry, run_with_retries


def _runs(codes):
    calls = iter(codes)
    return lambda: ("run", next(calls))


@pytest.mark.parametrize(
    ("codes", "retries", "final", "attempts"),
    [
        ([EXIT_FOLLOWER_LOST, 0], 1, 0, 2),  # lost node, retried, succeeded
        ([EXIT_HEAD_FAILED, EXIT_FOLLOWER_LOST], 1, EXIT_FOLLOWER_LOST, 2),  # out of retries
        ([1], 3, 1, 1),  # the job's own failure is not retried: a fresh cluster would repeat it
        ([EXIT_JOB_TIMEOUT], 3, EXIT_JOB_TIMEOUT, 1),
        ([EXIT_FOLLOWER_LOST], 0, EXIT_FOLLOWER_LOST, 1),  # no --retries: as before
    ],
)
def test_only_a_lost_node_is_retried(codes, retries, final, attempts):
    said, log = [], RetryLog()
    assert run_with_retries(_runs(codes), retries, said.append, log) == final
    assert len(log.attempts) == attempts and len(said) == attempts - 1


def test_modal_container_raises_for_a_lost_node_only_with_retries():
    with pytest.raises(NodeLostError):
        raise_for_retry(EXIT_FOLLOWER_LOST, retries=1)
    assert raise_for_retry(EXIT_FOLLOWER_LOST, retries=0) == EXIT_FOLLOWER_LOST
    assert raise_for_retry(3, retries=2) == 3


@pytest.mark.parametrize(("rank", "raises"), [(0, True), (1, False)])
def test_the_modal_container_body_hands_a_lost_node_to_modals_retries(monkeypatch, rank, raises):
    """Rank 0's container body raises for a lost follower when the plan carries ``--retries``
    (Modal would count a returned exit code as a success and never retry); only Modal's
    cluster-info call and our bootstrap's outcome are stood in for."""
    import modal.experimental

    from modal_rl.cluster import bootstrap
    from modal_rl.cluster.backend import JobRequest
    from modal_rl.cluster.backend_modal import ModalBackend, container_main
    from modal_rl.cluster.spec import ClusterSpec

    plan = ModalBackend().make_plan(ClusterSpec(nodes=2, gpu="H100:8", retries=2), JobRequest(["true"]))
    assert plan.retries == 2
    info = type("Info", (), {"rank": rank, "container_ips": ["fd00::1", "fd00::2"]})()
    monkeypatch.setattr(modal.experimental, "get_cluster_info", lambda: info)
    monkeypatch.setattr(bootstrap, "bootstrap", lambda *a, **k: EXIT_FOLLOWER_LOST)
    if raises:
        with pytest.raises(NodeLostError):
            container_main(plan.to_json())
    else:
        assert container_main(plan.to_json())["exit_code"] == EXIT_FOLLOWER_LOST


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_follower_killed_run_is_retried_and_resumes_from_its_checkpoint():
    from benchmarks.chaos_cluster import run_scenario

    result = run_scenario(quick=True, say=print)
    d = result["details"]
    assert [a["exit_code"] for a in d["attempts"]] == [EXIT_FOLLOWER_LOST, 0], d
    assert d["loss_reported_after_s"] is not None and d["loss_reported_after_s"] < 10.0, d
    assert d["resumed_from"] == d["checkpoint_step_at_kill"] > 0, d  # from its checkpoint, not step 0
    assert 0 <= result["steps_lost"] <= result["steps_since_checkpoint"], result
    assert result["final_weights_match"] is True and result["completed"] is True
    assert result["leaked_processes"] == 0
