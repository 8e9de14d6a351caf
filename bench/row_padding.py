"""The rows a batch-invariant CPU engine's linears compute, against the rows its steps hold: the padding.

Under ``model.batch_invariant`` every CPU linear call takes a size from a fixed ladder (``workers/cpu/
row_tiles.py``), so a step of N rows costs what the ladder's sizes covering N cost. Wall-clock comparisons
on a 2-core VM spread by 5-10% between runs; this count does not: the scheduler is the engine's own
(``coordinator_from_config``), fed bench/e2e.py's chat workload (``ignore_eos``: every request's length is
fixed), with one token back per row, and no model runs. Printed per alignment of the steps (what the
scheduler aims a step's tokens at) and ladder: the steps, and the padded rows as a share of the real ones.

    python bench/row_padding.py [--requests 256]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster.config import load_config, resolve  # noqa: E402
from cluster.engine.setup import coordinator_from_config  # noqa: E402
from e2e_workloads import BATCH, chat_workload, model_dir_for  # noqa: E402
from processors import SamplingParams  # noqa: E402
from workers.cpu.row_tiles import ladder  # noqa: E402
from workers.wire import StepResult  # noqa: E402

TILE = 64
LADDERS = {"the tile alone": (), "halvings 8-32 (before)": (8, 16, 32), "multiples of 8 (now)": ladder(TILE, 8)}


def step_sizes(alignment: int, requests: int) -> list[int]:
    """The tokens of every step the scheduler makes for the chat workload, aiming at multiples of ``alignment``."""
    model_dir = model_dir_for("smollm2", "float32")
    config = load_config({"model": {"path": str(model_dir), "max_model_len": 1024, "cpu_row_tile": TILE,
                                    "cpu_smallest_row_tile": alignment},
                          "scheduler": {"max_num_seqs": BATCH}})
    coordinator = coordinator_from_config(resolve(config), num_blocks=4096, block_size=16)
    for i, (prompt, max_tokens) in enumerate(chat_workload(model_dir, requests)):
        coordinator.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=f"r{i}")
    sizes = []
    while coordinator.has_unfinished():
        plan = coordinator.next_plan()
        if plan is None:
            continue
        sizes.append(int(np.asarray(plan.num_tokens).sum()))
        lo, hi = plan.shards.tolist()[0]
        token = np.full(hi - lo, 100, np.int32)
        coordinator.accept_step(plan, [StepResult(0, plan.step, (lo, hi), token, np.ones(hi - lo, np.int32), {})])
        coordinator.take_outputs()
    return sizes


def computed_rows(rows: int, sizes: tuple[int, ...]) -> int:
    """What ``in_tiles`` computes for a call of ``rows``: whole tiles, the rest in the smallest size holding it."""
    whole, rest = divmod(rows, TILE)
    return whole * TILE + (next((s for s in sizes if s >= rest), TILE) if rest else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    args = parser.parse_args()
    print(f"bench/e2e.py's chat workload, {args.requests} requests, {BATCH} rows at most, linears in calls of "
          f"{TILE} rows or a ladder size")
    for alignment, label in ((TILE, "steps aimed at multiples of 64"), (8, "steps aimed at multiples of 8 (now)"),
                             (1, "steps not aimed")):
        sizes = step_sizes(alignment, args.requests)
        real = sum(sizes)
        for name, ladder_sizes in LADDERS.items():
            computed = sum(computed_rows(s, ladder_sizes) for s in sizes)
            print(f"{label:40s} ladder {name:24s}: {len(sizes):4d} steps, {real} rows, "
                  f"computed {computed} = {computed / real:.3f}x (padding {computed / real - 1:.1%})")


if __name__ == "__main__":
    main()
