"""What one coordinator costs per step at 1 to 64 workers x 256 rows, with fake workers (no model).

Each step: the workers' results come in, the coordinator accepts the tokens and finishes
rows (``accept_step``), schedules and builds the next plan (``next_plan``) and serializes it
once (``pickle``, what one object-store put or one compiled-graph write costs): that is the
critical path, while the workers wait. Building outputs (``take_outputs``: detokenization,
``RequestOutput``\\s) is off the path: the engine does it while the workers compute.

Fake workers answer at once with random tokens for the rows they own, drawn uniformly from
the tokens that decode to whole characters (a model writing text emits a byte fragment of a
multi-byte character only inside such a character; the tiny vocabulary's 128 fragments, a
quarter of it, would otherwise make up a quarter of all tokens). A row hits EOS 1 in 512.
With speculative decoding they accept a random prefix of each row's drafts plus one token.
Three request mixes:

- ``final``: seeded random sampling, final-only outputs, no stop strings (``generate``, batch jobs)
- ``stream``: every request streams; half have two stop strings, a quarter ask for 2 logprobs
- ``spec``: as ``final`` with n-gram speculative decoding, k = 3

Also: the bytes of one pickled plan and of one worker's pickled result, and one real
``Worker`` (its sampler and processor replicas, a fake model that returns random logits)
fed the same plans at the largest W: its host time per step without the model.

``--before DIR`` runs the same measurement in another checkout (e.g. a ``git worktree`` of
the commit before the change) in a subprocess first, and prints both with their ratio.

    python bench/coordinator_scale.py [--workers 1 4 16 64] [--mixes final stream spec] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(os.environ.get("RAYSAMPLE_TREE", Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from cluster.config import load_config, resolve  # noqa: E402

try:
    from cluster.engine.setup import coordinator_from_config  # noqa: E402
except ImportError:  # checkouts from before issue 82 (--before)
    try:
        from coordinator.factory import coordinator_from_config  # noqa: E402
    except ImportError:  # from before the coordinator was split into rooms
        from coordinator.coordinator import coordinator_from_config  # noqa: E402
from processors import SamplingParams  # noqa: E402

ROWS_PER_WORKER = 256
BLOCK_SIZE = 16
VOCAB = 512
ARRAYS = (ROOT / "workers" / "wire.py").exists()  # the wire types' home after issue 25
if ARRAYS:
    from workers.wire import StepResult  # noqa: E402
else:  # a checkout from before (--before)
    from coordinator.plan import StepResult  # noqa: E402
try:
    from workers.wire import TokenLogprobs  # noqa: E402
except ImportError:  # its home before issue 39 (--before)
    from workers.sample.sampler import TokenLogprobs  # noqa: E402


def config(workers: int, mix: str) -> Any:
    rows = ROWS_PER_WORKER * workers
    raw = {
        "model": {"tiny": "default", "max_model_len": 512},
        "cluster": {"num_workers": workers},
        "scheduler": {"max_num_seqs": rows, "max_num_batched_tokens": rows * 64, "seed": 0},
        "cache": {"block_size": BLOCK_SIZE},
    }
    if mix == "spec":
        raw["speculative"] = {"num_speculative_tokens": 3, "draft_policy": "fixed"}
    return load_config(raw)


def build(workers: int, mix: str, rng: random.Random) -> Any:
    cfg = config(workers, mix)
    coordinator = coordinator_from_config(resolve(cfg), num_blocks=ROWS_PER_WORKER * 40, block_size=BLOCK_SIZE)
    for i in range(ROWS_PER_WORKER * workers * 3):
        prompt = [rng.randrange(10, VOCAB) for _ in range(rng.randint(16, 64))]
        kwargs: dict[str, Any] = {"temperature": 0.8, "seed": i, "max_tokens": rng.randint(64, 400)}
        if mix == "stream":
            if i % 2:
                kwargs["stop"] = ["zq!", " xo"]
            if i % 4 == 0:
                kwargs["logprobs"] = 2
        coordinator.add_request(prompt, SamplingParams(**kwargs), final_only=mix != "stream")
    return cfg, coordinator


def logprob_rows(coordinator: Any) -> np.ndarray:
    """Rows of the last plan whose requests asked for logprobs (what a worker's sampler knows)."""
    if not ARRAYS:
        return np.zeros(0, np.int64)
    table = coordinator.scheduler.table
    return np.array([r for r, slot in enumerate(coordinator._plan_slots.tolist())
                     if table.requests[slot].params.logprobs is not None], dtype=np.int64)


def text_tokens(tokenizer: Any) -> np.ndarray:
    """Token ids (>= 10) whose bytes decode to whole characters on their own."""
    backend = tokenizer.backend_tokenizer
    ids = [i for i in range(10, VOCAB) if "\ufffd" not in backend.decode([i], skip_special_tokens=True)]
    return np.array(ids, dtype=np.int32)


TEXT_TOKENS: np.ndarray | None = None


def fake_results(plan: Any, workers: int, rng: np.random.Generator, wants_logprobs: np.ndarray) -> list[Any]:
    """Each worker's answer to ``plan``: one random token per row, or accepted drafts + one."""
    results = []
    vocab = TEXT_TOKENS
    if ARRAYS:
        for w in range(workers):
            lo, hi = (int(x) for x in plan.shards[w])
            n = hi - lo
            if plan.draft_counts is not None:
                drafts = plan.draft_counts[lo:hi]
                accepted = np.minimum(rng.integers(0, 4, n), drafts)
                counts = (accepted + 1).astype(np.int32)
                tokens = rng.choice(vocab, int(counts.sum()))
                offsets = plan.draft_offsets
                for i in np.flatnonzero(accepted):  # accepted drafts are the drafts themselves
                    r = lo + i
                    first = int(counts[:i].sum())
                    tokens[first:first + accepted[i]] = plan.draft_tokens[offsets[r]:offsets[r] + accepted[i]]
            else:
                counts = None
                tokens = rng.choice(vocab, n)
                tokens[rng.random(n) < 1 / VOCAB] = 2
            logprobs = {}
            for r in wants_logprobs[(wants_logprobs >= lo) & (wants_logprobs < hi)].tolist():
                k = int(counts[r - lo]) if counts is not None else 1
                logprobs[r] = [TokenLogprobs([3, 4], [-0.5, -1.2], 3, -0.5, 1) for _ in range(k)]
            results.append(StepResult(worker_id=w, step=plan.step, rows=(lo, hi), tokens=tokens, counts=counts,
                                      logprobs=logprobs))
        return results
    for w in range(workers):
        lo, hi = plan.shards[w]
        tokens = []
        for r in range(lo, hi):
            drafts = plan.drafts[r] if plan.drafts is not None else []
            k = min(int(rng.integers(0, 4)), len(drafts))
            tok = int(rng.choice(vocab))
            tokens.append(list(drafts[:k]) + [2 if rng.random() < 1 / VOCAB else tok])
        logprobs = [[TokenLogprobs([3, 4], [-0.5, -1.2], 3, -0.5, 1) for _ in t] for t in tokens]
        results.append(StepResult(worker_id=w, step=plan.step, rows=(lo, hi), tokens=tokens, logprobs=logprobs))
    return results


def fake_worker(cfg: Any, worker_id: int) -> Any:
    if ARRAYS:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
        from fake_runner import RandomLogitsRunner
    else:  # a checkout from before it existed (--before)
        class RandomLogitsRunner:  # type: ignore[no-redef]
            def __init__(self, vocab: int, seed: int) -> None:
                self.vocab, self.seconds = vocab, 0.0

            def forward(self, work: list[Any]) -> torch.Tensor:
                start = time.perf_counter()
                out = torch.randn(sum(w.num_logits for w in work), self.vocab)
                self.seconds += time.perf_counter() - start
                return out
    from workers.sample.sampler import Sampler
    from workers.step.worker import Worker

    sampler = Sampler(cfg.engine_config(None, VOCAB, cfg.model.max_model_len), "cpu", cfg.custom_processors())
    return Worker(worker_id, RandomLogitsRunner(VOCAB, seed=worker_id), sampler)


def measure(workers: int, mix: str, steps: int, worker_side: bool) -> dict[str, Any]:
    rng = random.Random(workers)
    nprng = np.random.default_rng(workers)
    global TEXT_TOKENS
    cfg, coordinator = build(workers, mix, rng)
    TEXT_TOKENS = text_tokens(coordinator.tokenizer)
    worker = fake_worker(cfg, 0) if worker_side else None
    critical, off, rows, plan_bytes, result_bytes, worker_ms, apply_ms = [], [], [], [], [], [], []
    plan = coordinator.next_plan()
    warmup = 4 if mix != "spec" else 6
    for step in range(warmup + steps):
        if worker is not None:
            before = worker.runner.seconds
            start = time.perf_counter()
            result = worker.step(plan)
            worker_ms.append((time.perf_counter() - start - (worker.runner.seconds - before)) * 1000)
            apply_ms.append(getattr(getattr(result, "timings", result), "plan_s", float("nan")) * 1000)
        results = fake_results(plan, workers, nprng, logprob_rows(coordinator))
        if step == warmup:
            result_bytes.append(len(pickle.dumps(results[0], protocol=5)))
        start = time.perf_counter()
        coordinator.accept_step(plan, results)
        plan = coordinator.next_plan()
        blob = pickle.dumps(plan, protocol=5)
        mid = time.perf_counter()
        coordinator.take_outputs()
        end = time.perf_counter()
        if plan is None:
            raise RuntimeError("the batch ran dry: add requests")
        if step >= warmup:
            critical.append((mid - start) * 1000)
            off.append((end - mid) * 1000)
            rows.append(coordinator.num_running())
            plan_bytes.append(len(blob))
    med_rows = statistics.median(rows)
    out = {
        "workers": workers, "mix": mix, "rows": med_rows,
        "critical_ms": statistics.median(critical), "off_ms": statistics.median(off),
        "plan_bytes": int(statistics.median(plan_bytes)), "result_bytes": result_bytes[0],
    }
    drafts = getattr(coordinator, "_drafts", None)
    if drafts is not None:  # the batched n-gram drafter's memory: its map and the token histories
        m = drafts.map
        out["drafter_mib"] = (m.uid.nbytes + m.key.nbytes + m.value.nbytes + m._claim.nbytes
                              + drafts.history.nbytes) / 2**20
    if worker_ms:
        out["worker_ms"] = statistics.median(worker_ms[warmup:])
        out["apply_ms"] = statistics.median(apply_ms[warmup:])
    return out


def run_all(workers: list[int], mixes: list[str], steps: int) -> list[dict[str, Any]]:
    rows = []
    for mix in mixes:
        for w in workers:
            row = measure(w, mix, steps, worker_side=(w == max(workers) and mix == "final"))
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def table(title: str, rows: list[dict[str, Any]], before: dict[tuple[int, str], dict[str, Any]]) -> None:
    print(f"\n{title}")
    head = f"{'mix':7} {'W':>3} {'rows':>6} {'critical ms':>12} {'us/row':>7} {'off-path ms':>12} {'plan B':>9} {'result B':>9}"
    if before:
        head += f" {'before ms':>10} {'speed-up':>9}"
    print(head)
    for r in rows:
        line = (f"{r['mix']:7} {r['workers']:>3} {r['rows']:>6.0f} {r['critical_ms']:>12.2f} "
                f"{1000 * r['critical_ms'] / r['rows']:>7.2f} {r['off_ms']:>12.2f} {r['plan_bytes']:>9} "
                f"{r['result_bytes']:>9}")
        b = before.get((r["workers"], r["mix"]))
        if b is not None:
            line += f" {b['critical_ms']:>10.2f} {b['critical_ms'] / r['critical_ms']:>8.1f}x"
        print(line)
    for r in rows:
        if "drafter_mib" in r:
            print(f"n-gram drafter memory at W={r['workers']} ({r['rows']:.0f} rows): {r['drafter_mib']:.0f} MiB")
    for r in rows:
        if "worker_ms" in r:
            b = before.get((r["workers"], r["mix"]), {})
            extra = f" (before: {b['worker_ms']:.2f} ms)" if "worker_ms" in b else ""
            print(f"worker host time per step without the model, W={r['workers']} "
                  f"({r['rows']:.0f} global rows): {r['worker_ms']:.2f} ms{extra}; of which applying the plan "
                  f"(tokens, BatchUpdate, processors' update_state): {r['apply_ms']:.2f} ms, the rest its own "
                  f"{ROWS_PER_WORKER} rows (model inputs, sampling on the CPU)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--mixes", nargs="+", default=["final", "stream", "spec"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--before", help="another checkout to measure first, in a subprocess")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    before: dict[tuple[int, str], dict[str, Any]] = {}
    if args.before:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--json", "--steps", str(args.steps),
               "--workers", *map(str, args.workers), "--mixes", *args.mixes]
        env = {**os.environ, "RAYSAMPLE_TREE": str(Path(args.before).resolve())}
        done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        for row in json.loads(done.stdout):
            before[(row["workers"], row["mix"])] = row
    rows = run_all(args.workers, args.mixes, args.steps)
    if args.json:
        print(json.dumps(rows))
        return
    if before:
        table(f"before ({args.before})", list(before.values()), {})
    table("now" if before else "coordinator per step", rows, before)


if __name__ == "__main__":
    main()
