"""The sampler as a GPU runs it (``Sampler.sync_free``): no host read of a device value before the sampled
ids, with every sampling feature on; counted on CPU by ``workers.sample.sync_counter``. Its top-k/top-p
(one sort, no host read) keeps what the CPU's windowed search keeps, and its tokens equal the CPU path's."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from cluster.engine.local_engine import LocalEngine
from processors import SamplingParams
from processors.builtins.top_k_top_p import TopKTopPLogitsProcessor, sorted_thresholds
from workers.sample.sampler import Sampler
from workers.sample.sync_counter import SyncCounter

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}


def every_feature(i: int) -> SamplingParams:
    """Seeded random sampling with top-k, top-p and min-p, the three penalties, a logit bias, bad words, min
    tokens, logprobs on some rows, allowed ids on some, and a JSON-schema grammar on half of them."""
    return SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=i,
                          repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2, logit_bias={5: 2.0},
                          bad_words=["fox"], min_tokens=3, logprobs=2 if i % 3 == 0 else None,
                          structured_outputs={"json": SCHEMA} if i % 2 else None,
                          allowed_token_ids=list(range(10, 300)) if i % 4 == 2 else None)


def run(sync_free: bool, counted: list[tuple[int, int]] | None = None, monkeypatch=None) -> list[list[int]]:
    engine = LocalEngine({"model": {"tiny": "default", "max_model_len": 128}, "scheduler": {"max_num_seqs": 8}})
    try:
        engine.workers[0].sampler.sync_free = sync_free
        if counted is not None:
            sample = Sampler.sample

            def counting(self, logits, rows=None):
                with SyncCounter() as before:
                    pending = sample(self, logits, rows)
                counted.append((before.total, before.uploads))
                return pending

            monkeypatch.setattr(Sampler, "sample", counting)
        outs = engine.generate([f"prompt {i}" for i in range(8)], [every_feature(i) for i in range(8)])
        assert all(o.error is None for o in outs), [o.error for o in outs]
        return [o.token_ids for o in outs]
    finally:
        engine.shutdown()


def test_a_step_with_every_feature_reads_nothing_on_the_host_before_the_sampled_ids(monkeypatch):
    counted: list[tuple[int, int]] = []
    tokens = run(True, counted, monkeypatch)
    assert len(counted) >= 10 and all(reads == 0 for reads, _ in counted), counted
    assert all(uploads > 0 for _, uploads in counted)  # the step's metadata goes up (pinned, non-blocking on CUDA)
    assert tokens == run(False)  # the GPU's path gives the CPU's tokens


def test_the_counter_counts_what_a_gpu_would_wait_for():
    logits = torch.randn(4, 10)
    with SyncCounter() as counter:
        host = torch.from_numpy(np.arange(4))
        host.tolist()  # host data read on the host: no wait
        index = host.to(logits.device)  # an upload
        picked = logits[index]
        picked.max().item()
        bool((picked > 0).any())
        picked.cpu()
        picked.to("cpu")
        picked.argmax(dim=-1).tolist()
    assert dict(counter.counts) == {"item": 1, "bool": 1, "cpu": 1, "to(cpu)": 1, "tolist": 1}
    assert counter.uploads == 1


@pytest.mark.parametrize("seed", range(4))
def test_the_sorted_top_k_top_p_keeps_what_the_windowed_search_keeps(seed):
    """Random rows with ties, masked tokens, flat and peaked rows, every combination of k and p off and on."""
    rng = random.Random(seed)
    rows, vocab = 48, 3000
    torch.manual_seed(seed)
    logits = torch.randn(rows, vocab) * torch.tensor([rng.choice([0.1, 1.0, 5.0]) for _ in range(rows)]).unsqueeze(1)
    logits[::5, : vocab // 2] = float("-inf")
    logits[1::7] = torch.round(logits[1::7])  # many ties
    k = np.array([rng.choice([0, 1, 7, 50, 2999, 5000]) for _ in range(rows)])
    p = np.array([rng.choice([1.0, 0.95, 0.5, 0.01]) for _ in range(rows)], dtype=np.float32)
    windowed = TopKTopPLogitsProcessor._filter(logits.clone(), np.minimum(k, vocab), p)
    threshold = sorted_thresholds(logits.clone(), torch.from_numpy(np.minimum(k, vocab)), torch.from_numpy(p))
    sorted_ = logits.clone().masked_fill_(logits < threshold, float("-inf"))
    assert torch.equal(torch.isinf(windowed), torch.isinf(sorted_))
