"""How ``make test`` spreads the suite over its xdist workers, checked on a small suite of its own.

Module-scoped fixtures here are expensive (a Ray cluster, a ``ray start`` head, two data-parallel
engines, the real model's reference outputs), so each test module must run whole on one worker. The
suite asked for that with ``--dist loadgroup`` and an ``xdist_group`` per module; with pytest 9.2 xdist
no longer groups anything that way (pytest-dev/pytest-xdist#1386) and said nothing: half the modules
ran on both workers, building their fixtures twice.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODULE = '''
import json, os
import pytest

@pytest.fixture(scope="module")
def built(request):
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"module": request.module.__name__, "worker": os.environ["PYTEST_XDIST_WORKER"]}}) + "\\n")

@pytest.mark.parametrize("i", range({count}))
def test_one(built, i):
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"test_of": __name__, "worker": os.environ["PYTEST_XDIST_WORKER"]}}) + "\\n")
'''


def make_test_flags() -> list[str]:
    """The pytest arguments ``make test`` passes, read from the Makefile."""
    recipe = re.search(r"^test:.*\n\t(.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert recipe, "no test recipe in the Makefile"
    words = shlex.split(recipe[1])
    return words[words.index("pytest") + 1:]


def test_make_test_runs_each_module_whole_on_one_worker_in_collection_order(tmp_path):
    log = tmp_path / "log.jsonl"
    suite = tmp_path / "suite"
    suite.mkdir()
    names = ["test_c_first", "test_a_second", "test_b_third", "test_d_fourth"]
    for count, name in enumerate(names, 2):  # the later ones larger: a reorder by size would run them first
        (suite / f"{name}.py").write_text(textwrap.dedent(MODULE.format(log=str(log), count=count)))
    # The order the suite's conftest gives (the Ray modules first): here, not alphabetical.
    (suite / "conftest.py").write_text(textwrap.dedent(f"""
        ORDER = {names!r}
        def pytest_collection_modifyitems(config, items):
            items.sort(key=lambda item: ORDER.index(item.module.__name__))
    """))
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           *make_test_flags(), str(suite)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    built = [r for r in records if "module" in r]
    assert sorted(r["module"] for r in built) == sorted(names), built  # each module's fixture built once
    workers = {r["module"]: r["worker"] for r in built}
    for record in records:
        if "test_of" in record:
            assert record["worker"] == workers[record["test_of"]], records
    # Each worker takes the modules in the conftest's order (no reordering by size).
    for worker in set(workers.values()):
        mine = [r["module"] for r in built if r["worker"] == worker]
        assert mine == sorted(mine, key=names.index), built
