"""The Ray executor's answer to a hung compiled-graph step, without a Ray instance: a graph double whose
teardown, as Ray's does, returns only once the actors running its loop are gone."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import ray

from cluster.engine.executor import WorkersLost
from cluster.ray.ray_executor import RayExecutor


class GraphWaitingOnItsActors:
    def __init__(self, actors_gone: threading.Event) -> None:
        self.actors_gone = actors_gone
        self.torn_down = False

    def teardown(self, kill_actors: bool = False) -> None:
        self.actors_gone.wait(timeout=10)  # cancels each actor's loop first: a hung one's never ends
        logging.getLogger("ray.dag.compiled_dag_node").error("Error cancelling worker task")  # as Ray logs it
        self.torn_down = self.actors_gone.is_set()


def test_a_hung_step_kills_the_workers_before_the_teardown_waits_on_them(monkeypatch, caplog):
    """The teardown used to run first and wait out ``call_timeout_s`` (120 s by default) on the hung actor
    before any replacement started, then log a traceback per actor."""
    gone = threading.Event()
    killed = []
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: (killed.append(actor), gone.set()))
    executor = object.__new__(RayExecutor)
    executor.timeout_s = 2.0  # the teardown's wait; less than the graph's own
    executor.workers = {0: "worker 0", 1: "worker 1"}
    executor._graph = graph = GraphWaitingOnItsActors(gone)
    ray_dag_level = logging.getLogger("ray.dag").level

    with caplog.at_level(logging.DEBUG):
        lost = executor._collect_compiled(SimpleNamespace(step=3), ray.exceptions.GetTimeoutError("no answer"))

    assert lost == WorkersLost([0, 1], "hung (no answer in 2s)")
    assert killed == ["worker 0", "worker 1"]
    assert graph.torn_down  # finished within the wait: the actors were gone when it began
    assert executor._graph is None
    assert not [r for r in caplog.records if r.name.startswith("ray.dag")]  # nothing new in them
    assert logging.getLogger("ray.dag").level == ray_dag_level
