"""The seed's processors, taken from the vLLM docs at test time, run with only their imports changed.

The docs live beside the checkout (``../shared/seeds``), as in CI; nothing of
them is stored in this repository.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import engine_config
from test_loading import check_only_enabled_rows_change

from processors import build_logitsprocs

SEED = Path(__file__).resolve().parents[3] / "shared" / "seeds" / "002_6bef3e47111d5456.txt"

OUR_IMPORTS = """
import logging
from typing import Any, Optional
import torch
from processors import EngineConfig as VllmConfig
from processors import SamplingParams
from processors import (AdapterLogitsProcessor, BatchUpdate, LogitsProcessor,
                        MoveDirectionality, RequestLogitsProcessor)
logger = logging.getLogger("seed")
"""


def _python_blocks(text: str) -> list[str]:
    return [textwrap.dedent(b) for b in re.findall(r"``` python\n(.*?)\n\s*```", text, flags=re.S)]


def _without_imports(block: str) -> str:
    """Drop the block's import statements (multi-line ones too) and the '...' elisions."""
    out, open_parens = [], 0
    for line in block.splitlines():
        stripped = line.strip()
        if open_parens:
            open_parens += stripped.count("(") - stripped.count(")")
            continue
        if stripped.startswith(("import ", "from ")):
            open_parens = stripped.count("(") - stripped.count(")")
            continue
        if stripped == "...":
            continue
        out.append(line)
    return "\n".join(out)


@pytest.fixture(scope="module")
def seed_namespace():
    if not SEED.exists():
        pytest.skip(f"vLLM seed docs not beside this checkout ({SEED})")
    blocks = _python_blocks(SEED.read_text())
    dummy = next(b for b in blocks if "class DummyLogitsProcessor" in b)
    wrapped = next(b for b in blocks if "class WrappedPerReqLogitsProcessor" in b)
    namespace: dict = {}
    exec(OUR_IMPORTS + _without_imports(dummy) + "\n" + _without_imports(wrapped), namespace)
    return namespace


@pytest.mark.parametrize("name", ["DummyLogitsProcessor", "WrappedPerReqLogitsProcessor"])
def test_seed_processor_runs_after_changing_imports(seed_namespace, name):
    cls = seed_namespace[name]
    procs = build_logitsprocs(engine_config(), torch.device("cpu"), False, custom=[cls])
    (proc,) = [p for p in procs.all if type(p) is cls]
    check_only_enabled_rows_change(proc)
