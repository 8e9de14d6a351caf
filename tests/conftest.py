"""``make test`` runs the suite on two pytest-xdist workers (``--dist loadfile --no-loadscope-reorder``): each
module whole on one worker, so its fixtures are built once, and the modules that start Ray first, then the
other long ones, so the short tests fill the cores around them (``tests/test_suite_layout.py`` holds the
Makefile to both). Ray tests may run beside each other: every private instance is started with
``address="local"`` (a bare ``ray.init()`` joins whichever cluster this host started last), and the
``ray start --head`` of test_ray_job.py takes ports of its own and stops only its own processes. The ``ray`` marker
(``-m "not ray"``) selects the tests without a cluster."""

import gc
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))  # helper modules, imported by their own names

RAY_FOLDER = "tests/cluster/ray/"  # every test in it is on Ray


def share_cores_between_xdist_workers() -> None:
    """Under ``-n N`` the N workers run side by side: each runs torch on its share of the cores, as a
    Ray worker does, instead of every worker's OpenMP team on every core. On 2 cores and ``-n 2``,
    two threads each cost a third more CPU for the same tests (OpenMP teams waiting on each other on
    oversubscribed cores), and the suite is CPU-bound. Child processes (the job CLI, Ray's workers)
    inherit the setting; a worker sized by ``cluster.cpus_per_worker`` still takes its share."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if count < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    threads = max(1, len(os.sched_getaffinity(0)) // count)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


share_cores_between_xdist_workers()


def faster_imports() -> None:
    """Child processes (pytest's workers, the job CLI, Ray's actors) start with ``support/startup``'s
    ``sitecustomize``: transformers' lazy import table read from one file instead of rebuilt from its
    3,345 model files in every process, and no cyclic collection while a module executes."""
    startup = os.path.join(os.path.dirname(__file__), "support", "startup")
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if startup not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [startup, *paths] if p)
    from workers.host_cache import cache_root

    cache_root().mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RAYSAMPLE_TEST_TRANSFORMERS_TABLE", str(cache_root() / "transformers-import-table.pkl"))
    os.environ.setdefault("RAYSAMPLE_TEST_IMPORTS_UNCOLLECTED", "1")


faster_imports()


def no_idle_ray_processes() -> None:
    """Ray starts a Python worker per logical CPU as the first driver connects, ahead of need. The
    suite's private instances declare more CPUs than the machine has (a bundle per worker), and most of
    those workers never ran anything (31 in a run, about 1 CPU-s each): actors start their own."""
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    # Ray Data reads parquet footers in a pool of actors (3 per read here, 1.3 CPU-s each to start): the
    # suite's files are one or two small ones, which one actor reads as well.
    os.environ.setdefault("RAY_DATA_PARQUET_FOOTER_NUM_ACTORS", "1")


no_idle_ray_processes()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Collection imported every test module and with them torch, transformers and Ray: some 500,000
    objects that live as long as the worker. Frozen, the full collections the tests' own garbage sets
    off no longer walk them (as the engine's actors do after start-up, ``cluster.ray.startup_heap``)."""
    gc.freeze()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ray: starts or joins a Ray cluster")
    config.addinivalue_line("markers", "long: a module of half a minute or more without Ray, scheduled early")


@pytest.hookimpl(tryfirst=True)  # before -m selects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(RAY_FOLDER):
            item.add_marker(pytest.mark.ray)
    items.sort(key=schedule_rank)


def schedule_rank(item: pytest.Item) -> int:
    """The long Ray modules first, then the other long ones (``pytestmark = pytest.mark.long``), then the rest,
    so that under xdist the short modules fill the cores at the end: test_static_decode.py, last in file
    order, ran 66 s on one worker after the other had finished (a suite of 788 s here)."""
    if item.get_closest_marker("ray") is not None:
        return 0
    return 1 if item.get_closest_marker("long") is not None else 2
