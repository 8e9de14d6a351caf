"""Every process of the suite (pytest's workers, the job CLI it runs, Ray's engine actors) starts here:
conftest puts this folder on ``PYTHONPATH``.

``import transformers`` reads all 3,345 of its model files to build its lazy import table
(``define_import_structure``), about 0.6 CPU-s in each of the ~170 processes a run starts that import
it. The table is a function of the installed files alone, so it is kept in one file for the suite
(``RAYSAMPLE_TEST_TRANSFORMERS_TABLE``), keyed by transformers' version and the folder's modification
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
    transformers = sys.modules.get("transformers")
    version = getattr(transformers, "__version__", None)
    stamps = []
    for root, dirs, _ in os.walk(str(module_path)):  # a file added or removed changes its folder's time
        stamps.append(os.stat(root).st_mtime_ns)
        dirs.sort()
    return (version, str(module_path), prefix, tuple(stamps))


def _kept(build):
    def define_import_structure(module_path, prefix=None):
        try:
            key = _key(module_path, prefix)
            with open(TABLE, "rb") as f:
                tables = pickle.load(f)
            return tables[key]
        except Exception:  # noqa: BLE001 - no table yet, another version's, or unreadable: build it
            pass
        table = build(module_path, prefix)
        try:
            try:
                with open(TABLE, "rb") as f:
                    tables = pickle.load(f)
            except Exception:  # noqa: BLE001
                tables = {}
            tables[key] = table
            partial = f"{TABLE}.{os.getpid()}"
            with open(partial, "wb") as f:
                pickle.dump(tables, f)
            os.replace(partial, TABLE)  # readers see the old table or the new one, never half of one
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
