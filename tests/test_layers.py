"""The layers run one way (processors <- workers <- coordinator <- cluster), and no module of a layer
imports itself back through others (no import circles): import-linter checks both. The rooms stay readable:
no file over 500 lines, no function over 80, in the packages a step runs through."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_layers_contract_holds():
    lint = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "7 kept, 0 broken" in done.stdout


MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 80


def test_no_file_over_500_lines_and_no_function_over_80_in_coordinator_workers_and_cluster():
    files, functions = [], []
    for package in ("coordinator", "workers", "cluster"):
        for path in sorted((ROOT / package).rglob("*.py")):
            source = path.read_text()
            name = path.relative_to(ROOT)
            if source.count("\n") > MAX_FILE_LINES:
                files.append(f"{name}: {source.count(chr(10))} lines")
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        functions.append(f"{name}: {node.name} {length} lines")
    assert files == [] and functions == [], files + functions


def test_import_raysample_gives_the_public_names_without_starting_ray():
    """One import for users; the names are the packages' own objects; Ray loads only with an engine handle."""
    script = ("import sys, raysample, processors, cluster.entrypoints.llm, cluster.entrypoints.data\n"
              "assert raysample.SamplingParams is processors.SamplingParams\n"
              "assert raysample.LogitsProcessor is processors.LogitsProcessor\n"
              "assert raysample.LLM is cluster.entrypoints.llm.LLM and raysample.build_processor is cluster.entrypoints.data.build_processor\n"
              "missing = [n for n in raysample.__all__ if getattr(raysample, n, None) is None]\n"
              "assert not missing, missing\n"
              "print('ray' in sys.modules)\n")
    bare = subprocess.run([sys.executable, "-c", "import sys, raysample; print('ray' in sys.modules)"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert bare.returncode == 0 and bare.stdout.strip() == "False", bare.stderr[-2000:]
    names = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert names.returncode == 0, names.stderr[-2000:]
