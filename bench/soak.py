"""Memory soak: many short requests through one long-lived Engine; the coordinator's memory stays flat.

Sends ``--requests`` short requests (in waves of ``--wave``) through one Ray Engine on the
"micro" tiny model and samples the coordinator actor's resident memory (psutil) after each
wave. Reference: its memory after the first wave, so the ratio printed is growth, not size.
Also reports how many requests the coordinator still holds at the end (0 when delivered
requests are forgotten).

    python bench/soak.py [--requests 20000] [--wave 1000] [--tokens 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
import ray  # noqa: E402

from cluster import Engine  # noqa: E402
from processors import SamplingParams  # noqa: E402


@ray.remote(num_cpus=0)
def rss_of(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--wave", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=4)
    args = parser.parse_args()
    engine = Engine.from_config({"model": {"tiny": "micro", "max_model_len": 64},
                                 "cluster": {"num_workers": 1, "compiled_graph": True},
                                 "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 1024}})
    pid = ray.get(engine._actor.__ray_call__.remote(lambda self: __import__("os").getpid()))
    params = SamplingParams(max_tokens=args.tokens, temperature=1.0, ignore_eos=True)
    samples, done, started = [], 0, time.monotonic()
    while done < args.requests:
        n = min(args.wave, args.requests - done)
        outs = engine.generate([f"soak request {done + i}" for i in range(n)], params)
        assert all(len(o.token_ids) == args.tokens for o in outs)
        done += n
        samples.append(ray.get(rss_of.remote(pid)))
        print(f"{done:>6} requests  coordinator RSS {samples[-1] / 2**20:7.1f} MiB", flush=True)
    held = ray.get(engine._actor.__ray_call__.remote(lambda self: len(self.core.coordinator.requests)))
    engine.shutdown()
    first, last, peak = samples[0], samples[-1], max(samples)
    print(f"{done} requests in {time.monotonic() - started:.0f}s; coordinator RSS after wave 1 "
          f"{first / 2**20:.1f} MiB, at the end {last / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB: "
          f"end/first = {last / first:.3f}x; requests still held: {held}")


if __name__ == "__main__":
    main()
