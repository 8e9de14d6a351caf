"""``make test`` runs the suite in two passes: every test that does not start or join a Ray cluster on two
pytest-xdist workers (``-m "not ray"``, each module whole on one worker, so its fixtures are built once),
then the Ray tests (marked ``ray``, or in tests/cluster/ray) one after another, alone on the machine, as a
plain ``pytest`` runs everything. Run beside the other tests, the jobs of test_ray_job.py's ``ray start
--head`` failed (no job agent, a rejected auth token), which they never do alone or on a loaded machine:
not understood yet, so the Ray tests keep the machine to themselves."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))  # helper modules, imported by their own names

RAY_FOLDER = "tests/cluster/ray/"  # every test in it is on Ray


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ray: starts or joins a Ray cluster (make test runs these one at a time)")


@pytest.hookimpl(tryfirst=True)  # before -m selects and xdist reads the groups into the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(RAY_FOLDER):
            item.add_marker(pytest.mark.ray)
        item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    # The long Ray modules first, so that under xdist the short tests fill the cores around them.
    items.sort(key=lambda item: item.get_closest_marker("ray") is None)
