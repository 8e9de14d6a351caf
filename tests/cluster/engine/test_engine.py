"""The in-process engine end to end on the tiny model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster.engine.local_engine import LocalEngine
from coordinator.request import FinishReason
from processors import SamplingParams

TINY = {"tiny": "default", "max_model_len": 192}


def engine_with(**overrides) -> LocalEngine:
    config = {"model": TINY, "scheduler": {"max_num_seqs": 6}, **overrides}
    return LocalEngine(config)


@pytest.fixture(scope="module")
def engine() -> LocalEngine:
    return engine_with(processors=["processors.examples:DummyLogitsProcessor"])


@pytest.fixture(scope="module")
def reference_model(engine):
    from workers.model.tiny import ensure_tiny_model

    return AutoModelForCausalLM.from_pretrained(ensure_tiny_model("default"), dtype=torch.float32).eval()


def reference_greedy(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt_ids) :].tolist()


PROMPTS = [
    "Hello there",
    "The quick brown fox jumps over the lazy dog and keeps on running far away",
    "café 你好 🙂",
    "a",
    "Think first, then answer. Question: what is the answer?",
    "Numbers like 0 1 2 3",
    "Unicode matters: Grüße",
    "batch",
    "Logits processors steer generation: they mask, bias or reshape",
]


@pytest.mark.parametrize("num_workers", [1, 2])
def test_greedy_matches_generate_with_staggered_arrivals(reference_model, num_workers):
    """More requests than slots, different lengths and max_tokens, joining at different steps."""
    engine = engine_with(cluster={"num_workers": num_workers}, scheduler={"max_num_seqs": 4})
    tok = engine.tokenizer
    prompt_ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    max_tokens = [5 + (7 * i) % 23 for i in range(len(PROMPTS))]
    arrival_step = [0, 0, 1, 3, 3, 4, 9, 10, 15]
    ids = {}
    finals = {}
    step = 0
    while len(finals) < len(PROMPTS):
        for i, at in enumerate(arrival_step):
            if at == step:
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens[i], ignore_eos=True)
                ids[engine.add_request(prompt_ids[i], params)] = i
        for out in engine.step():
            if out.finished:
                finals[ids[out.request_id]] = out
        step += 1
        assert step < 500
    for i, ids_ in enumerate(prompt_ids):
        assert finals[i].token_ids == reference_greedy(reference_model, ids_, max_tokens[i]), PROMPTS[i]
        assert finals[i].finish_reason == FinishReason.LENGTH


def test_seeded_random_identical_across_batch_compositions():
    target = SamplingParams(seed=77, temperature=0.9, top_k=40, top_p=0.95, max_tokens=24, ignore_eos=True)
    noise = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (3, 30, 11, 17, 8)]
    alone = engine_with().generate("The quick brown fox", target)[0].token_ids
    crowd = engine_with(scheduler={"max_num_seqs": 4}).generate(
        ["x y z", "Hello", "The quick brown fox", "a b", "café", "zz"], [noise[0], noise[1], target, *noise[2:]]
    )[2].token_ids
    two_workers = engine_with(cluster={"num_workers": 2}).generate(
        ["Hello", "The quick brown fox", "a"], [noise[3], target, noise[4]]
    )[1].token_ids
    assert alone == crowd == two_workers
    other_seed = engine_with().generate("The quick brown fox", SamplingParams(**{**target.to_dict(), "seed": 78}))
    assert other_seed[0].token_ids != alone


def _forced(token: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, logit_bias={token: 100.0}, **kwargs)


def test_eos_stops_unless_ignore_eos_and_min_tokens_delays_it(engine):
    eos = engine.tokenizer.eos_token_id
    stop, ignored, delayed = engine.generate(
        ["Hello"] * 3,
        [_forced(eos, max_tokens=10), _forced(eos, max_tokens=6, ignore_eos=True), _forced(eos, max_tokens=10, min_tokens=4)],
    )
    assert stop.token_ids == [eos] and stop.finish_reason == FinishReason.STOP and stop.stop_reason is None
    assert stop.text == ""
    assert ignored.token_ids == [eos] * 6 and ignored.finish_reason == FinishReason.LENGTH
    assert len(delayed.token_ids) == 5 and delayed.token_ids[-1] == eos and eos not in delayed.token_ids[:4]
    assert delayed.finish_reason == FinishReason.STOP


def test_stop_token_ids_and_logit_bias_visible(engine):
    out = engine.generate("Hello", _forced(300, max_tokens=10, stop_token_ids=[300], min_tokens=2))[0]
    assert out.finish_reason == FinishReason.STOP and out.stop_reason == 300
    assert len(out.token_ids) == 3 and out.token_ids[-1] == 300 and 300 not in out.token_ids[:2]
    biased = engine.generate("Hello", _forced(300, max_tokens=4))[0]
    assert biased.token_ids == [300] * 4


def test_stop_strings_across_tokens_excluded_or_included(engine):
    piece = engine.tokenizer.decode([300])
    assert len(piece) >= 2
    stop_str = piece[1:] + piece[0]  # only appears across a token boundary
    plain, included = engine.generate(
        ["Hello", "Hello"],
        [_forced(300, max_tokens=10, stop=[stop_str]), _forced(300, max_tokens=10, stop=[stop_str], include_stop_str_in_output=True)],
    )
    assert plain.finish_reason == FinishReason.STOP and plain.stop_reason == stop_str
    assert plain.text == piece[0] and len(plain.token_ids) == 2
    assert included.text == piece[0] + stop_str


def test_text_is_right_across_multibyte_tokens(engine):
    tok = engine.tokenizer
    ids = tok.encode("你好世界 🙂 Grüße", add_special_tokens=False)
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # some tokens are partial characters
    out = engine.generate("Hello", SamplingParams(temperature=0.0, max_tokens=len(ids), ignore_eos=True,
                                                  logit_bias=None))[0]
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    # Force the multi-byte sequence through the detokenizer token by token.
    from coordinator.output.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tok, tok.encode("x", add_special_tokens=False))
    pieces = [detok.push(t) for t in ids]
    assert "".join(pieces) + detok.flush() == "你好世界 🙂 Grüße"
    assert all("\ufffd" not in p for p in pieces)


def test_streaming_deltas_add_up(engine):
    outs = list(engine.run(engine.submit_many(["Hello there", "café"], SamplingParams(seed=5, max_tokens=12,
                                                                                       ignore_eos=True))))
    for rid in {o.request_id for o in outs}:
        mine = [o for o in outs if o.request_id == rid]
        assert sum(len(o.new_token_ids) for o in mine) == 12
        assert "".join(o.new_text for o in mine) == mine[-1].text
        assert mine[-1].finished and not any(o.finished for o in mine[:-1])


def test_final_only_requests_give_one_output_equal_to_the_streamed_one(engine):
    """``generate`` asks for final outputs only (vLLM's FINAL_ONLY): no per-step outputs are built,
    and the one output is what a streamed request ends with, stop strings and n > 1 included."""
    prompts = ["Hello there", "café", "The quick"]
    params = [SamplingParams(seed=5, max_tokens=12, ignore_eos=True),
              SamplingParams(seed=6, max_tokens=40, stop=[" the"], ignore_eos=True),
              SamplingParams(seed=7, max_tokens=9, n=2, ignore_eos=True)]
    streamed_ids = engine.submit_many(prompts, params)
    streamed = list(engine.run(streamed_ids))
    assert len(streamed) > 3 * len(prompts)  # streaming requests still get an output per step
    ids = engine.submit_many(prompts, params, final_only=True)
    outs = list(engine.run(ids))
    assert len(outs) == len(prompts) and all(o.finished for o in outs)
    final = {o.request_id: o for o in streamed if o.finished}
    by_id = {o.request_id: o for o in outs}
    for streamed_id, rid in zip(streamed_ids, ids):
        want, got = final[streamed_id], by_id[rid]
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        assert [c.text for c in got.outputs] == [c.text for c in want.outputs]
        assert [c.new_text for c in got.outputs] == [c.text for c in got.outputs]  # one delta: everything
        assert [c.finish_reason for c in got.outputs] == [c.finish_reason for c in want.outputs]
    assert len(by_id[ids[2]].outputs) == 2


def test_abort_mid_generation(engine):
    keep = engine.add_request("Hello", SamplingParams(seed=1, max_tokens=20, ignore_eos=True))
    victim = engine.add_request("World", SamplingParams(seed=2, max_tokens=100, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.abort(victim)
    assert not engine.abort(victim)
    finals = {o.request_id: o for o in engine.run([keep, victim]) if o.finished}
    assert finals[victim].finish_reason == FinishReason.ABORT and 0 < len(finals[victim].token_ids) < 100
    assert finals[keep].finish_reason == FinishReason.LENGTH and len(finals[keep].token_ids) == 20


def test_bad_requests_fail_alone(engine):
    good = SamplingParams(seed=3, max_tokens=5, ignore_eos=True)
    outs = engine.generate(
        ["x " * 300, "Hello", "Hello", "", "Hello", [1, 2, 10**6]],
        [
            good,
            SamplingParams(logit_bias={10**6: 1.0}),
            good,
            good,
            SamplingParams(extra_args={"target_token": "nope"}),
            good,
        ],
    )
    errors = [o.error for o in outs]
    assert "longer than the maximum model length of 192" in errors[0]
    assert "logit_bias has token id(s) [1000000] outside the vocabulary" in errors[1]
    assert errors[2] is None and len(outs[2].token_ids) == 5
    assert errors[3] == "prompt is empty"
    assert "target_token must be a non-negative integer token id" in errors[4]
    assert "prompt has token id(s) [1000000]" in errors[5]
    assert all(o.finish_reason == FinishReason.ERROR for i, o in enumerate(outs) if i != 2)


def test_admission_checks_ranges_and_token_zero_is_a_target(engine):
    vocab = engine.coordinator.model.vocab_size
    outs = engine.generate(
        ["Hello"] * 5,
        [
            SamplingParams(max_tokens=3, logprobs=vocab + 1),
            SamplingParams(max_tokens=3, logprobs=21),  # model.max_logprobs = 20, as vLLM
            SamplingParams(max_tokens=3, logprobs=20, seed=1),
            SamplingParams(max_tokens=3, seed=2**64 - 1, ignore_eos=True),
            SamplingParams(max_tokens=3, extra_args={"target_token": 0}),
        ],
    )
    assert "greater than max allowed: 20" in outs[0].error and "greater than max allowed: 20" in outs[1].error
    assert outs[2].error is None and len(outs[2].outputs[0].logprobs[0]) in (20, 21)
    assert outs[3].error is None and len(outs[3].token_ids) == 3  # an unsigned 64-bit seed is fine
    assert outs[4].token_ids == [0, 0, 0]
    with pytest.raises(ValueError, match="seed must be in"):
        SamplingParams(seed=2**64)


def test_custom_processor_only_on_requests_that_enable_it(engine):
    outs = engine.generate(
        ["Hello", "Hello", "The quick"],
        [
            SamplingParams(seed=1, max_tokens=8, ignore_eos=True, extra_args={"target_token": 42}),
            SamplingParams(seed=1, max_tokens=8, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, extra_args={"target_token": 7}),
        ],
    )
    assert outs[0].token_ids == [42] * 8
    assert outs[1].token_ids != [42] * 8
    assert outs[2].token_ids == [7] * 8


def test_logprobs_per_token(engine):
    out = engine.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 4
    for token, position in zip(out.token_ids, out.logprobs):
        # vLLM's shape: {token id: Logprob}, the sampled token first, then the top 3 by rank
        assert next(iter(position)) == token and len(position) == 3
        assert position[token].rank == 1 and [lp.rank for lp in position.values()] == [1, 2, 3]
        assert position[token].decoded_token == engine.tokenizer.decode([token])
        assert max(lp.logprob for lp in position.values()) == position[token].logprob


def test_logprobs_minus_one_is_the_whole_vocabulary():
    engine = engine_with(model={"tiny": "default", "max_model_len": 64, "max_logprobs": -1})
    vocab = engine.coordinator.model.vocab_size
    out = engine.generate("Hello", SamplingParams(seed=3, max_tokens=2, logprobs=-1, ignore_eos=True))[0]
    assert out.error is None
    for token, position in zip(out.token_ids, out.logprobs):
        assert len(position) == vocab and sorted(lp.rank for lp in position.values()) == list(range(1, vocab + 1))
        total = torch.logsumexp(torch.tensor([lp.logprob for lp in position.values()]), 0)
        assert abs(float(total)) < 1e-4  # a full distribution
    capped = LocalEngine({"model": {"tiny": "default", "max_model_len": 64}})  # max_logprobs 20, as vLLM
    refused, = capped.generate("Hello", SamplingParams(max_tokens=2, logprobs=-1))
    assert f"Requested sample logprobs of {vocab}, which is greater than max allowed: 20" in refused.error


def test_max_model_len_caps_generation():
    engine = engine_with(model={"tiny": "default", "max_model_len": 24})
    prompt = list(range(10, 30))
    out = engine.generate(prompt, SamplingParams(seed=0, max_tokens=100, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == FinishReason.LENGTH


class _SlowOnly:
    """The tokenizer without its Rust backend: the detokenizer's fallback path."""

    def __init__(self, tok) -> None:
        self._tok = tok

    def decode(self, ids, skip_special_tokens=True):
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_streamed_text_equals_a_full_decode_on_both_paths(engine):
    """DecodeStream (Rust tokenizers) and the offset fallback both reproduce a full decode of any tokens."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from coordinator.output.detokenizer import IncrementalDetokenizer

    tok = engine.tokenizer
    prompt = tok.encode("Context: ", add_special_tokens=False)
    vocab = len(tok)

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=24), st.booleans(), st.integers(0, 24))
    def check(ids, skip_special, split):
        full = tok.decode(prompt + ids, skip_special_tokens=skip_special)[len(tok.decode(prompt, skip_special_tokens=skip_special)):]
        for source in (tok, _SlowOnly(tok)):
            detok = IncrementalDetokenizer(source, prompt, skip_special_tokens=skip_special)
            assert (detok._stream is not None) == (source is tok)
            text = "".join(detok.push(t) for t in ids) + detok.flush()
            assert text == detok.text == full
            # Decoding left for later (no stop strings): caught up in two goes, same text.
            later = IncrementalDetokenizer(source, prompt, skip_special_tokens=skip_special)
            later.catch_up(ids[:split])
            later.catch_up(ids)
            later.flush()
            assert later.text == full and later.consumed == len(ids)

    check()


def test_delivered_requests_are_forgotten_so_a_long_lived_engine_stays_flat(engine):
    for round_ in range(3):
        outs = engine.generate([f"short {round_} {i}" for i in range(40)], SamplingParams(max_tokens=3, seed=round_))
        assert all(o.finished and len(o.token_ids) <= 3 for o in outs)
    engine.step()  # the last rows leave the batch, then their requests are dropped
    engine.step()
    c = engine.coordinator
    assert len(c.requests) == len(c.rows) == len(c.detokenizers) == len(c.outputs.emitted) == 0


def test_buffered_outputs_carry_every_delta_in_one_snapshot():
    from cluster.engine.engine_core import merge_outputs
    from coordinator.request import CompletionOutput, RequestOutput

    def snapshot(tokens, new):
        return RequestOutput("r", "p", [1], [CompletionOutput(0, "".join(map(str, tokens)), tokens,
                                                              new_text="".join(map(str, new)), new_token_ids=new)],
                             finished=False)

    merged = merge_outputs(merge_outputs(snapshot([1], [1]), snapshot([1, 2], [2])), snapshot([1, 2, 3], [3]))
    assert merged.outputs[0].new_token_ids == [1, 2, 3] and merged.outputs[0].new_text == "123"
    assert merged.outputs[0].token_ids == [1, 2, 3]


def test_vllm_prompt_dicts_are_accepted_as_vllm_takes_them(engine):
    """TextPrompt / TokensPrompt dicts give the same outputs as the plain forms."""
    ids = engine.tokenizer.encode("Hello there", add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = engine.generate(["Hello there", ids], params)
    dicts = engine.generate([{"prompt": "Hello there"}, {"prompt_token_ids": ids}], params)
    assert [o.token_ids for o in dicts] == [o.token_ids for o in plain]
    assert engine.generate({"prompt_token_ids": ids}, params)[0].token_ids == plain[1].token_ids


@pytest.mark.parametrize("prompts,message", [
    ({"prompt": "a", "multi_modal_data": {"image": 0}}, "multi-modal data is not supported"),
    ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one of 'prompt'"),
    (None, "prompts must be a string, a list of token ids"),
])
def test_prompt_forms_we_do_not_take_are_refused_clearly(engine, prompts, message):
    with pytest.raises((ValueError, TypeError), match=message):
        engine.generate(prompts, SamplingParams(max_tokens=2))


def test_text_decoded_ahead_while_workers_compute_is_the_text_decoded_at_the_end(engine, monkeypatch):
    """With ``overlap_outputs`` (GPU or simulated workers) the step loop brings running requests'
    text up to date while the workers compute (``Coordinator.decode_ahead``) instead of all at
    once when they finish: the same text, multi-byte characters, stop strings and n > 1 included."""
    import functools

    from coordinator.coordinator import Coordinator

    prompts = ["Hello there", "café 🙂", "The quick"]
    params = [SamplingParams(seed=5, max_tokens=24, ignore_eos=True),
              SamplingParams(seed=6, max_tokens=40, stop=[" the"], ignore_eos=True),
              SamplingParams(seed=7, max_tokens=17, n=2, ignore_eos=True)]
    at_the_end = engine.generate(prompts, params)
    advanced = []
    decode_ahead = Coordinator.decode_ahead

    def counted(self):
        advanced.append(sum(d.consumed for d in self.detokenizers.values()))
        decode_ahead(self)

    monkeypatch.setattr(Coordinator, "decode_ahead", counted)
    from cluster.engine import engine_core

    monkeypatch.setattr(engine_core.EngineCore, "step",
                        functools.partialmethod(engine_core.EngineCore.step, overlap_outputs=True))
    ahead = engine.generate(prompts, params)
    assert len(advanced) > 10 and max(advanced) > 0  # decoded while running, not only at the end
    for want, got in zip(at_the_end, ahead):
        assert [(c.text, c.token_ids, c.finish_reason) for c in got.outputs] == [
            (c.text, c.token_ids, c.finish_reason) for c in want.outputs]


def test_an_id_used_again_and_again_never_leaks_its_row(engine):
    """A finished request leaves the batch at the next plan; an id given to a new request before that
    plan must not hide the old one (its slot was never released: after max_num_seqs reuses nothing
    could be admitted and the engine waited for ever). Unseeded, the id keys the sample: same output."""
    params = SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True)
    outs = []
    for k in range(3 * 6):  # three times the engine's max_num_seqs
        ids = engine.submit_many(["Hello there" if k % 2 == 0 else "café"], params, ["again"], final_only=True)
        outs.append(list(engine.results(ids)[ids[0]].outputs[0].token_ids))
    assert all(o == outs[0] for o in outs[::2]) and all(o == outs[1] for o in outs[1::2])
    assert sum(r is not None for r in engine.coordinator.scheduler.table.requests) <= 1


@pytest.mark.parametrize("convict", ["other", "aborted"])
def test_an_id_given_again_while_a_step_fails_is_not_taken_for_the_row_that_held_it(convict):
    """A client may abort a running request and give its id to a new one while a step is in flight.
    If that step fails, recovery walks the batch, which still holds the aborted row under that id:
    it must find the aborted row (release its slot, convict it if the error names it), never the
    new request, which is waiting (before, the new one was re-queued a second time, could be failed
    for the old one's error, and the old row's slot leaked)."""
    engine = engine_with()
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    engine.submit_many(["Hello there", "café au lait"], params, ["x", "other"])
    for _ in range(2):
        engine.step()
    coordinator = engine.coordinator
    coordinator.next_plan()  # the step in flight
    assert engine.abort("x")
    engine.add_request("Hello there", params, "x")
    row = coordinator.batch.row_of("x" if convict == "aborted" else "other")
    coordinator.fail_step([row], "step failed: boom", engine.executor.worker_ids)
    engine.executor.reset()
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    finals = {rid: [o for o in outs if o.finished] for rid, outs in outputs.items()}
    assert len(finals["x"]) == 1 and finals["x"][0].finish_reason == FinishReason.LENGTH
    new_x = list(finals["x"][0].outputs[0].token_ids)
    if convict == "other":
        assert finals["other"][0].finish_reason == FinishReason.ERROR
    assert all(r is None for r in coordinator.scheduler.table.requests)  # no slot held
    again = engine.submit_many(["Hello there"], params, ["x"], final_only=True)
    assert list(engine.results(again)[again[0]].outputs[0].token_ids) == new_x  # unseeded: keyed by the id
