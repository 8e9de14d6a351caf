"""``make test`` runs the suite on two pytest-xdist workers (``--dist loadgroup``): each module whole on one
worker, so its fixtures are built once, and the modules that start Ray first, so the short tests fill the
cores around them. Ray tests may run beside each other: every private instance is started with
``address="local"`` (a bare ``ray.init()`` joins whichever cluster this host started last), and the
``ray start --head`` of test_ray_job.py takes ports of its own and stops only its own processes. The ``ray``
marker (``-m "not ray"``) selects the tests without a cluster."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))  # helper modules, imported by their own names

RAY_FOLDER = "tests/cluster/ray/"  # every test in it is on Ray


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ray: starts or joins a Ray cluster")


@pytest.hookimpl(tryfirst=True)  # before -m selects and xdist reads the groups into the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(RAY_FOLDER):
            item.add_marker(pytest.mark.ray)
        item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    # The long Ray modules first, so that under xdist the short tests fill the cores around them.
    items.sort(key=lambda item: item.get_closest_marker("ray") is None)
