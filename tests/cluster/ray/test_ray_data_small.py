"""Ray Data on a cluster the engines would fill: 2 CPUs, 2 workers. The dataset is written, not left
waiting for a CPU that the workers hold."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_a_two_cpu_ray_writes_the_dataset_of_two_workers(tmp_path):
    script = textwrap.dedent(f"""
        import ray
        import pyarrow.parquet as pq
        from raysample import build_processor
        ray.init(address="local", num_cpus=2, include_dashboard=False)
        processor = build_processor({{"model": {{"tiny": "default", "max_model_len": 64}},
                                     "cluster": {{"num_workers": 2}}}},
                                    preprocess=lambda row: {{"prompt": row["q"], "sampling_params": {{"max_tokens": 4, "seed": 1}}}})
        processor(ray.data.from_items([{{"q": f"question {{i}}"}} for i in range(6)])).write_parquet({str(tmp_path / "out")!r})
        rows = pq.read_table({str(tmp_path / "out")!r}).to_pylist()
        print("ROWS", len(rows), sum(r["num_generated_tokens"] for r in rows), sum(r["error"] is None for r in rows))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ROWS 6 24 6" in done.stdout, done.stdout[-2000:]
    assert "the engines' 2 worker(s) ask for 0.5 CPU each" in done.stdout, done.stdout[-2000:]
