from __future__ import annotations

import torch
from helpers import VOCAB, engine_config

from coordinator.schedule.persistent_batch import BatchEntry, PersistentBatch
from processors import AdapterLogitsProcessor, SamplingParams


class SeenBy:
    """Records what a request-level callable was given."""

    calls: list = []


class TwoArg:
    def __call__(self, output_ids, logits):
        SeenBy.calls.append(("two", list(output_ids)))
        logits[0] = 100.0
        return logits


class ThreeArg:
    def __call__(self, prompt_ids, output_ids, logits):
        SeenBy.calls.append(("three", list(prompt_ids), list(output_ids)))
        out = logits.clone()  # out of place: the adapter must write it back
        out[1] = 100.0
        return out


class Adapter(AdapterLogitsProcessor):
    def is_argmax_invariant(self):
        return False

    def new_req_logits_processor(self, params):
        kind = (params.extra_args or {}).get("kind")
        return {"two": TwoArg, "three": ThreeArg}.get(kind, lambda: None)()


def test_adapter_two_and_three_arg_callables_and_none_disables():
    SeenBy.calls.clear()
    proc = Adapter(engine_config(), torch.device("cpu"), False)
    batch = PersistentBatch(4)
    outs = [[], [], []]
    batch.update(
        [],
        [
            BatchEntry("a", SamplingParams(extra_args={"kind": "two"}), [9], outs[0]),
            BatchEntry("b", SamplingParams(), [9], outs[1]),
            BatchEntry("c", SamplingParams(extra_args={"kind": "three"}), [8, 9], outs[2]),
        ],
    )
    proc.update_state(batch.take_update())
    outs[0].append(4)
    outs[2].append(5)  # live lists: the callables see the growth
    logits = torch.zeros(3, VOCAB)
    result = proc.apply(logits)
    assert result[0].argmax() == 0 and result[2].argmax() == 1
    assert torch.equal(result[1], torch.zeros(VOCAB))
    assert ("two", [4]) in SeenBy.calls and ("three", [8, 9], [5]) in SeenBy.calls
    # Shard application: rows 2..3 only.
    shard = proc.apply_rows(torch.zeros(1, VOCAB), slice(2, 3))
    assert shard[0].argmax() == 1
    # Removing "a" condenses "c" into row 0; digest changes with the state.
    before = proc.state_digest()
    batch.update(["a"], [])
    proc.update_state(batch.take_update())
    assert set(proc.req_info) == {0}
    assert proc.state_digest() != before


class Falsy:
    """A callable that is falsy: vLLM's adapter treats it as "not for this request"."""

    def __bool__(self) -> bool:
        return False

    def __call__(self, output_ids, logits):
        raise AssertionError("a falsy request-level processor must not be applied")


class FalsyAdapter(AdapterLogitsProcessor):
    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        return Falsy()


def test_a_falsy_request_level_callable_is_skipped():
    proc = FalsyAdapter(engine_config(), torch.device("cpu"), False)
    batch = PersistentBatch(2)
    batch.update([], [BatchEntry("a", SamplingParams(), [1], [])])
    proc.update_state(batch.take_update())
    logits = torch.zeros(1, VOCAB)
    assert proc.req_info == {} and torch.equal(proc.apply(logits), torch.zeros(1, VOCAB))
