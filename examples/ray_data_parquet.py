"""Parquet in, Parquet out: a Ray Data dataset through raysample engines.

    ray job submit --working-dir . -- python examples/ray_data_parquet.py \
        --input examples/prompts.parquet --output "$PWD/results/parquet"

Runs as well without ``ray job submit`` (it then starts a private Ray instance). Rows that
cannot run get their reason in the ``error`` column; the dataset goes on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from cluster.job_paths import JobPathError, check_job_paths  # noqa: E402
from cluster.ray.ray_cluster import ensure_ray  # noqa: E402
from raysample import build_processor, load_config  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("configs/default.yaml"))
    parser.add_argument("--input", type=Path, default=Path("examples/prompts.parquet"))
    parser.add_argument("--output", type=Path, required=True, help="a directory of Parquet files")
    parser.add_argument("--num-engines", type=int, default=None, help="overrides cluster.num_engines")
    args = parser.parse_args()
    try:
        check_job_paths(args.input, args.output, args.config)
    except JobPathError as exc:
        print(f"raysample: {exc}", file=sys.stderr)
        return 2
    config = load_config(args.config)
    if args.num_engines:
        config = config.model_copy(update={"cluster": config.cluster.model_copy(update={"num_engines": args.num_engines})})
    ensure_ray(config)  # the job's cluster under `ray job submit`, else a private one
    processor = build_processor(config, postprocess=lambda row: {
        "id": row["id"], "generated_text": row["generated_text"], "finish_reason": row["finish_reason"],
        "num_generated_tokens": row["num_generated_tokens"], "error": row["error"]})
    processor(ray.data.read_parquet(str(args.input))).write_parquet(str(args.output))
    rows = ray.data.read_parquet(str(args.output)).take_all()
    for row in sorted(rows, key=lambda r: r["id"]):
        shown = f"error: {row['error']}" if row["error"] else repr(row["generated_text"])
        print(f"[raysample] {row['id']} ({row['finish_reason']}): {shown}")
    errors = sum(1 for r in rows if r["error"])
    print(f"[raysample] {len(rows)} rows written to {args.output}, {errors} with an error")
    return 0


if __name__ == "__main__":
    sys.exit(main())
