"""Every process of the suite (pytest's workers, the job CLI it runs, Ray's engine actors) starts here:
conftest puts this folder on ``PYTHONPATH``.

``import transformers`` reads all 3,345 of its model files to build its lazy import table
(``define_import_structure``), about 0.6 CPU-s in each of the ~170 processes a run starts that import
it. The table is a function of the installed files alone, so it is kept in one file for the suite
(``RAYSAMPLE_TEST_TRANSFORMERS_TABLE``), keyed by transformers' version and its files' modification
times. Nothing else changes: the table transformers would build is the table it gets.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import pickle
import sys

TABLE = os.environ.get("RAYSAMPLE_TEST_TRANSFORMERS_TABLE")
TARGET = "transformers.utils.import_utils"


def _key(module_path: object, prefix: str | None) -> tuple:
    """A few stats, not a walk of the tree (a walk costs a third of what the cache saves): installing or
    upgrading transformers rewrites its ``__init__.py`` files and recreates its folders. An edit in place
    to one model file of an installed transformers is not seen: delete the table then."""
    transformers = sys.modules.get("transformers")
    package = os.path.dirname(getattr(transformers, "__file__", "") or "")
    folder = str(module_path)  # a package's folder, or its __init__.py
    folder = folder if os.path.isdir(folder) else os.path.dirname(folder)
    stamps = tuple(os.stat(path).st_mtime_ns for path in
                   (folder, os.path.join(folder, "__init__.py"), os.path.join(package, "__init__.py")))
    return (getattr(transformers, "__version__", None), str(module_path), prefix, stamps)


# key -> that table pickled on its own: the file is read once per process, and each call unpickles only
# its own table, a fresh object (transformers changes the tables it is given).
_tables: dict | None = None


def _read_tables() -> dict:
    try:
        with open(TABLE, "rb") as f:
            return pickle.load(f)
    except Exception:  # noqa: BLE001 - no table yet, or unreadable
        return {}


def _kept(build):
    def define_import_structure(module_path, prefix=None):
        global _tables
        try:
            key = _key(module_path, prefix)
            if _tables is None:
                _tables = _read_tables()
            return pickle.loads(_tables[key])
        except Exception:  # noqa: BLE001 - not in the table (another version's, a new install): build it
            pass
        table = build(module_path, prefix)
        try:
            # Another process may have added tables since: merge into the file's current ones. Tables of
            # installs that are gone (a clean clone's venv, deleted) and of the older format are dropped.
            tables = {k: v for k, v in _read_tables().items() if isinstance(v, bytes) and os.path.exists(k[1])}
            tables[key] = pickle.dumps(table)
            partial = f"{TABLE}.{os.getpid()}"
            with open(partial, "wb") as f:
                pickle.dump(tables, f)
            os.replace(partial, TABLE)  # readers see the old table or the new one, never half of one
            _tables = tables
        except Exception:  # noqa: BLE001 - a read-only cache costs time, not correctness
            pass
        return table

    return define_import_structure


class _WrapImportUtils(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.define_import_structure = _kept(module.define_import_structure)

        spec.loader.exec_module = exec_module
        return spec


if TABLE:
    sys.meta_path.insert(0, _WrapImportUtils())


# ----- no cyclic collection while a module executes -----
#
# A module's execution allocates its functions, classes and constants, which all live as long as the
# process; every generation-0 collection triggered meanwhile walks them again. Importing torch, ray and
# transformers took 2.28 CPU-s with the collector on, 1.87 with it off and 2.04 paused as here (the
# objects an import made are walked once when it returns). The collector is paused
# around each outermost import (not inside one: a nested import finds it paused and leaves it so) and
# runs as before once the import returns; code that pauses it itself is left alone.

import _frozen_importlib
import gc

_find_and_load = _frozen_importlib._find_and_load


def _find_and_load_uncollected(name, import_):
    if not gc.isenabled():
        return _find_and_load(name, import_)
    gc.disable()
    try:
        return _find_and_load(name, import_)
    finally:
        gc.enable()


if os.environ.get("RAYSAMPLE_TEST_IMPORTS_UNCOLLECTED"):
    _frozen_importlib._find_and_load = _find_and_load_uncollected
