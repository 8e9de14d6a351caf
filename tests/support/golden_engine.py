"""Golden outputs of the in-process engine: a fixed mixed workload, recorded once, replayed by tests.

Recorded from main before the coordinator's step loop was vectorized (issue 25); the engine
must keep reproducing them token for token, finish reasons, logprobs and aborts included.

    python tests/support/golden_engine.py            # rewrite tests/golden/engine_outputs.json
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cluster.engine.local_engine import LocalEngine  # noqa: E402
from coordinator.request import top_of  # noqa: E402
from processors import SamplingParams  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "engine_outputs.json"
# (name, number of workers, extra config)
SETUPS: list[tuple[str, int, dict[str, Any]]] = [
    ("w1", 1, {}),
    ("w2", 2, {}),
    ("w4", 4, {}),
    # 40 blocks of 4 tokens per worker: rows get preempted and recomputed.
    ("w2-tight", 2, {"cache": {"block_size": 4, "kv_cache_memory": 40 * 2 * 2 * 4 * 2 * 16 * 4}}),
    ("w2-spec", 2, {"speculative": {"num_speculative_tokens": 2, "draft_policy": "fixed"}}),
    # The paths the mixed workload only samples: structured outputs (regex, choice, JSON schema), thinking
    # budgets and a custom processor, next to everything above; then with spec decode on top.
    ("w2-features", 2, {"reasoning": {"start": "<think>", "end": "Final answer:"},
                        "processors": ["processors.examples:DummyLogitsProcessor"]}),
    ("w2-features-spec", 2, {"reasoning": {"start": "<think>", "end": "Final answer:"},
                             "processors": ["processors.examples:DummyLogitsProcessor"],
                             "speculative": {"num_speculative_tokens": 3, "draft_policy": "fixed"}}),
]
FEATURES = {
    0: {"structured_outputs": {"regex": "(yes|no|maybe) [a-z]{2,6}"}},
    1: {"structured_outputs": {"choice": ["fox", "dog", "café"]}},
    2: {"structured_outputs": {"json": {"type": "object", "properties": {"n": {"type": "integer"}},
                                         "required": ["n"]}}},
    3: {"thinking_token_budget": 3},
    4: {"thinking_token_budget": 0},
    5: {"extra_args": {"target_token": 42}},
}
NUM_REQUESTS = 60
ABORT_AT = {5: ["r7", "r30"], 12: ["r41"]}  # step -> request ids aborted before that step


def engine_for(num_workers: int, extra: dict[str, Any]) -> LocalEngine:
    config = {
        "model": {"tiny": "loopy", "max_model_len": 160},
        "cluster": {"num_workers": num_workers},
        # Pipelined explicitly (CPU workers default to the synchronous step; speculative decoding runs
        # synchronously): the goldens were recorded synchronously, so this holds the two equal;
        # tests/workers/step/test_pipelined_step.py runs the switch off.
        "scheduler": {"max_num_seqs": 12, "max_num_batched_tokens": 96, "consistency_check_every": 1,
                      "async_scheduling": None if "speculative" in extra else True},
        "cache": {"block_size": 4},
        **extra,
    }
    return LocalEngine(config)


def workload(tokenizer: Any, features: bool = False) -> list[tuple[str, str | list[int], SamplingParams, int]]:
    """(request id, prompt, params, arrival step) of every request; fixed by a seeded RNG. ``features``:
    every third request also asks for one of ``FEATURES`` (the engine needs a reasoning section)."""
    rng = random.Random(25)
    words = "the quick brown fox jumps over lazy dog batch cache token row yes no maybe café 你好 🙂".split()
    out = []
    for i in range(NUM_REQUESTS):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(2, 30)))
        kind = i % 6
        max_tokens = rng.randint(4, 40)
        if kind == 0:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        elif kind == 1:
            params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1000 + i, max_tokens=max_tokens)
        elif kind == 2:  # unseeded: keyed by request id and the engine seed
            params = SamplingParams(temperature=1.0, max_tokens=max_tokens, min_tokens=2)
        elif kind == 3:
            params = SamplingParams(temperature=0.7, seed=i, n=2, max_tokens=max_tokens)
        elif kind == 4:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=["e", "ox"],
                                    include_stop_str_in_output=bool(i % 4 == 0))
        else:
            params = SamplingParams(temperature=0.9, seed=i, logprobs=2, max_tokens=max_tokens,
                                    repetition_penalty=1.1, stop_token_ids=[rng.randint(3, 400)])
        if features and i % 3 == 0:
            feature = FEATURES[(i // 3) % len(FEATURES)]
            params = SamplingParams.from_dict({**params.to_dict(), **feature})
            if "thinking_token_budget" in feature:
                prompt += " <think>"
        prompt_in: str | list[int] = prompt if i % 5 else tokenizer.encode(prompt, add_special_tokens=False)
        out.append((f"r{i}", prompt_in, params, rng.randint(0, 10)))
    return out


def run_setup(num_workers: int, extra: dict[str, Any]) -> dict[str, Any]:
    engine = engine_for(num_workers, extra)
    requests = workload(engine.tokenizer, features="reasoning" in extra)
    finals: dict[str, Any] = {}
    step = 0
    while len(finals) < len(requests):
        for rid, prompt, params, at in requests:
            if at == step:
                engine.add_request(prompt, params, request_id=rid, final_only=bool(int(rid[1:]) % 2))
                wait_for_constraint(engine, rid)
        for rid in ABORT_AT.get(step, ()):
            engine.abort(rid)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = record(out)
        step += 1
        if step > 5000:
            raise RuntimeError("golden workload did not finish")
    ahead_rows = engine.stats()["ahead_rows"]
    engine.shutdown()
    return {"steps": step, "outputs": dict(sorted(finals.items())), "ahead_rows": ahead_rows}


def wait_for_constraint(engine: Any, request_id: str) -> None:
    """Grammars compile on a thread: wait for this request's, so admission (hence the schedule) is the same
    in every run."""
    group = engine.coordinator.requests[request_id]
    for child in group.children:
        if child.grammar is not None:
            child.grammar.exception()  # waits; a failure is the request's own error


def record(out: Any) -> dict[str, Any]:
    return {
        "error": out.error,
        "completions": [
            {
                "text": c.text,
                "token_ids": c.token_ids,
                "finish_reason": str(c.finish_reason) if c.finish_reason is not None else None,
                "stop_reason": c.stop_reason,
                "logprobs": None if c.logprobs is None else [
                    [token, round(position[token].logprob, 4),
                     [t for t, _ in top_of(position, token, 2)]]  # the workload asks logprobs=2
                    for token, position in zip(c.token_ids, c.logprobs)
                ],
            }
            for c in out.outputs
        ],
    }


# Logprobs are recorded rounded to 4 decimals; float kernels differ between CPUs (AVX2 and AVX-512
# take different oneDNN paths) by about 1e-5 here, so a recorded logprob is compared within this.
# Tokens, texts, finish and stop reasons, errors and top-token ids are compared exactly.
LOGPROB_TOLERANCE = 1e-3


def assert_same_record(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    """``got`` equals the recorded ``want`` exactly, except logprob values (within ``LOGPROB_TOLERANCE``)."""
    assert got["error"] == want["error"], where
    assert len(got["completions"]) == len(want["completions"]), where
    for i, (g, w) in enumerate(zip(got["completions"], want["completions"])):
        at = f"{where} completion {i}"
        for key in ("token_ids", "text", "finish_reason", "stop_reason"):
            assert g[key] == w[key], f"{at}: {key}"
        assert (g["logprobs"] is None) == (w["logprobs"] is None), at
        for j, ((token, value, top), (w_token, w_value, w_top)) in enumerate(zip(g["logprobs"] or [],
                                                                               w["logprobs"] or [])):
            assert (token, top) == (w_token, w_top), f"{at} position {j}: sampled/top token ids"
            assert abs(value - w_value) <= LOGPROB_TOLERANCE, f"{at} position {j}: logprob {value} vs {w_value}"


def main() -> None:
    golden = {name: {key: run[key] for key in ("steps", "outputs")}
              for name, workers, extra in SETUPS for run in [run_setup(workers, extra)]}
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {GOLDEN}: " + ", ".join(f"{k} {v['steps']} steps" for k, v in golden.items()))


if __name__ == "__main__":
    main()
