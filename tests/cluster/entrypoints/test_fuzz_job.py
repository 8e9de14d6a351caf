"""Random mixtures of good and bad lines through the job's command line (``main``, --local, in this
process: what runs is the whole CLI from its argument list, without a second torch import per run;
the console script and ``python -m`` are run as processes in test_job.py and test_hostile_input.py):
bad lines touch no good one."""

from __future__ import annotations

import json
from pathlib import Path

import fuzz_lines
import pytest
import yaml
from helpers import run_job_main

pytest.importorskip("logits_processor_zoo", reason="the optional 'zoo' extra is not installed")


def run(capsys, config: Path, source: Path, output: Path) -> None:
    done = run_job_main(capsys, "generate", "--config", str(config), "--input", str(source), "--output", str(output),
                        "--local")
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("seed", [1, 2])
def test_random_mixtures_in_process(tmp_path, capsys, seed):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(fuzz_lines.config(workers=2)))
    lines, goods = fuzz_lines.mixture(seed, good=14, bad=12)
    run(capsys, config, fuzz_lines.write(tmp_path / "mixed.jsonl", lines), tmp_path / "mixed-out.jsonl")
    run(capsys, config, fuzz_lines.write(tmp_path / "clean.jsonl", [json.dumps(g).encode() for g in goods]),
        tmp_path / "clean-out.jsonl")
    fuzz_lines.check(tmp_path / "mixed-out.jsonl", tmp_path / "clean-out.jsonl", lines, goods)
