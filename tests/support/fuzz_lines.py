"""Random mixtures of good and bad job lines, and the check that bad ones touched no good one.

Good lines are seeded, unseeded and greedy requests, some with the target-token processor.
Bad lines are bad JSON, bytes that are not UTF-8, bad parameters, out-of-range processor
arguments (``target_token`` past the vocabulary: the processor raises), requests that make a
batch-level processor raise or return a wrong-shaped tensor, a request-level callable that
raises, and bad kwargs for a zoo request-level processor.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PROCESSORS = [
    "processors.examples:DummyLogitsProcessor",
    "failing_processors:BoomAdapter",
    "failing_processors:BoomBatch",
    "failing_processors:WrongShape",
    {"class": "logits_processor_zoo.vllm:GenLengthLogitsProcessor", "request_level": True,
     "enable_with": "gen_length", "kwargs": {"boost_factor": 1.0}},
]


def config(workers: int) -> dict:
    return {
        "model": {"tiny": "default", "dtype": "float32", "max_model_len": 128},
        "cluster": {"num_workers": workers, "call_timeout_s": 60},
        "scheduler": {"max_num_seqs": 6, "seed": 0, "max_num_batched_tokens": 256},
        "cache": {"kv_cache_memory": "8MiB"},
        "processors": PROCESSORS,
        "defaults": {"max_tokens": 6, "temperature": 0.8},
    }


def good_line(rng: random.Random, i: int) -> dict:
    kind = rng.choice(["seeded", "unseeded", "greedy", "target"])
    params: dict = {"max_tokens": rng.randint(3, 9), "ignore_eos": True}
    if kind == "seeded":
        params["seed"] = rng.randint(0, 2**64 - 1)
    elif kind == "greedy":
        params["temperature"] = 0.0
    line = {"id": f"good-{i}", "prompt": f"request {i} {rng.choice(['alpha', 'beta', 'café', '你好'])}",
            "sampling_params": params}
    if kind == "target":
        line["extra_args"] = {"target_token": rng.randint(0, 500)}
    return line


BAD_KINDS = ["json", "bytes", "params", "params-type", "target", "batch", "shape", "adapter", "zoo", "logprobs",
             "seed"]


def bad_line(rng: random.Random, i: int) -> bytes:
    """Kinds cycle, so a mixture of at least len(BAD_KINDS) bad lines has every kind."""
    rid = f"bad-{i}"
    kind = BAD_KINDS[i % len(BAD_KINDS)]
    body = {"id": rid, "prompt": f"bad {i}", "sampling_params": {"max_tokens": 4}}
    if kind == "json":
        return b'{"id": "' + rid.encode() + b'", "prompt": '
    if kind == "bytes":
        return b'{"id": "' + rid.encode() + b'", "prompt": "caf\xe9"}'
    if kind == "params":
        body["sampling_params"] = {"temperature": -1}
    elif kind == "params-type":
        body["sampling_params"] = "max_tokens=3"
    elif kind == "target":
        body["extra_args"] = {"target_token": 10**6}  # past the vocabulary: the processor raises
    elif kind in ("batch", "shape", "adapter"):
        body["extra_args"] = {"boom": {"adapter": "apply"}.get(kind, kind)}
    elif kind == "zoo":
        body["extra_args"] = {"gen_length": {"no_such_argument": 1}}
    elif kind == "logprobs":
        body["sampling_params"] = {"logprobs": 10**6}
    elif kind == "seed":
        body["sampling_params"] = {"seed": 2**70}
    return json.dumps(body).encode()


def mixture(seed: int, good: int, bad: int) -> tuple[list[bytes], list[dict]]:
    """Lines in a random order, and the good lines alone (for the clean run)."""
    rng = random.Random(seed)
    goods = [good_line(rng, i) for i in range(good)]
    lines = [json.dumps(g).encode() for g in goods] + [bad_line(rng, i) for i in range(bad)]
    rng.shuffle(lines)
    return lines, goods


def write(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def check(mixed_output: Path, clean_output: Path, lines: list[bytes], goods: list[dict]) -> None:
    """Each good line's output equals its clean-run output; each bad line has exactly one error record."""
    clean = {r["id"]: r for r in map(json.loads, clean_output.read_text().splitlines())}
    records = [json.loads(line) for line in mixed_output.read_text().splitlines()]
    assert len(records) == len(lines)
    by_id: dict = {}
    for record in records:
        by_id.setdefault(record.get("id"), []).append(record)
    for g in goods:
        [got] = by_id[g["id"]]
        assert got["error"] is None, (g, got["error"])
        assert got["token_ids"] == clean[g["id"]]["token_ids"], g
    bad = [r for r in records if not str(r.get("id")).startswith("good-")]
    assert len(bad) == len(lines) - len(goods) and all(r["error"] for r in bad)
    errors = " | ".join(r["error"] for r in bad)
    for expected in ("not valid JSON", "not valid UTF-8", "temperature must be", "must be an object",
                     "DummyLogitsProcessor raised", "BoomBatch raised", "WrongShape raised", "BoomAdapter",
                     "GenLengthLogitsProcessor", "greater than max allowed", "seed must be in"):
        assert expected in errors, (expected, errors)
    named = [r for r in bad if r.get("id") is not None]
    assert len({r["id"] for r in named}) == len(named)  # one record each
