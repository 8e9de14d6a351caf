"""The suite runs on two pytest-xdist workers (``-n 2``, pyproject.toml): every test that starts or joins
a Ray cluster is marked ``ray`` and all of them run on one worker, one after another (two Ray instances on
one small machine would fight for its cores, and ``ray stop`` on a head would end the other's); each other
module runs whole on one worker, so a module's fixtures are built once."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))  # helper modules, imported by their own names

RAY_FOLDER = "tests/cluster/ray/"  # every test in it is on Ray


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ray: starts or joins a Ray cluster (these run one at a time, on one worker)")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(RAY_FOLDER) or item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.xdist_group("ray"))
        else:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
