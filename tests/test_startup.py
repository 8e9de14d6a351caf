"""The suite's start-up module (``tests/support/startup/sitecustomize.py``): transformers gets the import
table it would build, read from the suite's file once one process has written it."""

import os
import subprocess
import sys
from pathlib import Path

STARTUP = Path(__file__).parent / "support" / "startup"

CHECK = """
import sitecustomize, pickle, sys
builds = []
kept = sitecustomize._kept
def counting(build):
    def counted(path, prefix=None):
        builds.append((str(path), prefix))
        return build(path, prefix)
    return kept(counted)
sitecustomize._kept = counting
import transformers
from transformers import LlamaConfig
from transformers.utils import import_utils
from pathlib import Path
models = Path(transformers.__file__).parent / "models"
fresh = import_utils.spread_import_structure(import_utils.create_import_structure_from_path(models))
fresh = {k: {f"models.{kk}": vv for kk, vv in v.items()} for k, v in fresh.items()}
assert import_utils.define_import_structure(models, prefix="models") == fresh
print(len(builds))
"""


def test_transformers_gets_its_own_import_table_and_the_second_process_reads_it(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(STARTUP), "RAYSAMPLE_TEST_TRANSFORMERS_TABLE": str(tmp_path / "table.pkl")}
    counts = [int(subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True,
                                 check=True).stdout.split()[-1]) for _ in range(2)]
    assert counts[0] > 0 and counts[1] == 0, counts  # built and kept once, then read
    assert (tmp_path / "table.pkl").exists()


def test_no_collection_while_a_module_executes_and_the_collector_runs_after(tmp_path):
    (tmp_path / "probe_module.py").write_text("import gc\nCOLLECTING = gc.isenabled()\n")
    check = "import gc, probe_module; print(probe_module.COLLECTING, gc.isenabled())"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(STARTUP), str(tmp_path)]),
           "RAYSAMPLE_TEST_IMPORTS_UNCOLLECTED": "1"}
    assert subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True,
                          check=True).stdout.split() == ["False", "True"]


def test_a_process_the_suite_starts_runs_the_startup_module():
    """conftest put it on the environment's PYTHONPATH: the job CLI, Ray's actors and pytest's workers get it."""
    found = subprocess.run([sys.executable, "-c", "import sitecustomize; print(sitecustomize.__file__)"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(found).parent == STARTUP
