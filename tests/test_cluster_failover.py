"""A Redis Cluster failover under load (tests/failover.py): the master holding the load's
queue killed with -9 while submits and calls run, its replica promoted, the dead node back
as a replica; the same gateway process carries on."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.failover import run_failover


@pytest.mark.parametrize(("wait_replicas", "lag_s"), [(0, 0.0), (1, 1.0)])
def test_cluster_failover_under_load(tmp_path: Path, wait_replicas: int, lag_s: float) -> None:
    """Every acknowledged task ends completed or (without WAIT) lost, none stays pending; a
    client meets only 503s while the slot has no master, never a 500. With WAIT, none is lost
    even when the replica lagged a second behind: a submit is acknowledged only once the
    replica of its own slot's master has it."""
    fig = run_failover(tmp_path, wait_replicas, lag_s=lag_s, kind="cluster")
    print(fig.line())
    assert not fig.gateway_restarted
    assert fig.acknowledged > 100 and fig.unfinished == 0, fig.line()
    assert fig.completed + fig.lost == fig.acknowledged, fig.line()
    assert fig.promoted_s < 10 and fig.recover_s < 10 and fig.calls_resumed_s < 10, fig.line()
    assert set(fig.errors) <= {"503 redis_unavailable", "ConnectError", "ReadTimeout"}, fig.errors
    if wait_replicas:
        assert fig.lost == 0, fig.line()


def test_the_callers_master_dies_under_keyed_submits(tmp_path: Path) -> None:
    """The master holding a caller's quota and Idempotency-Keys (not the queue's) killed while
    every submit carries a key and counts against a daily quota: its submits answer 503 until
    the replica takes over, each sent again with its key makes exactly one task, and no task is
    lost (the queue's master never stopped)."""
    fig = run_failover(tmp_path, 0, kind="cluster", keyed=True, victim="user")
    print(fig.line())
    assert not fig.gateway_restarted
    assert fig.resent > 0, fig.line()  # the kill did refuse submits
    assert fig.split_keys == 0, fig.line()
    assert fig.acknowledged > 100 and fig.unfinished == 0 and fig.lost == 0, fig.line()
    assert fig.completed == fig.acknowledged, fig.line()
    assert set(fig.errors) <= {"503 redis_unavailable", "ConnectionError", "ReadTimeout"}, (
        fig.errors)
