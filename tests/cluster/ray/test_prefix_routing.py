"""Data-parallel engines route by prompt prefix: a document's questions go to one engine, the load stays
balanced. The routing alone, on stand-ins for the engines (no Ray cluster)."""

from __future__ import annotations

from collections import Counter

from cluster.ray.engine_group import EngineGroup
from processors import SamplingParams


class StandIn:
    """What the group calls on an engine to queue requests; notes which prompts it got."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.prompts: list[str] = []

    def submit_many(self, prompts, params, request_ids, final_only) -> list[str]:
        self.prompts += prompts
        return list(request_ids)


def group_of(k: int) -> tuple[EngineGroup, list[StandIn]]:
    engines = [StandIn(f"e{i}") for i in range(k)]
    return EngineGroup(engines, "routing", max_model_len=1024), engines


def test_a_documents_questions_go_to_one_engine_in_any_order_and_the_engines_share_the_documents():
    documents = [f"Document {d}: " + f"the text of document {d}, sentence after sentence. " * 12 for d in range(16)]
    prompts = [documents[d] + f" Question {q}?" for q in range(4) for d in range(16)]  # question-major
    group, engines = group_of(2)
    group.submit_many(prompts, SamplingParams(max_tokens=16))
    where = {p: i for i, e in enumerate(engines) for p in e.prompts}
    for document in documents:
        assert len({where[p] for p in prompts if p.startswith(document)}) == 1, document[:12]
    assert Counter(where.values()) == {0: 32, 1: 32}


def test_one_system_prompt_shared_by_every_request_still_spreads_over_every_engine():
    system = "You are a careful assistant who answers in one sentence. " * 8
    group, engines = group_of(3)
    group.submit_many([system + f"Question {i}?" for i in range(90)], SamplingParams(max_tokens=16))
    counts = [len(e.prompts) for e in engines]
    assert min(counts) >= 20, counts
