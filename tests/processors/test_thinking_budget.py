"""Thinking budget: exact counts with and without spec decode, prompt-opened thinking, natural end."""

from __future__ import annotations

import pytest

from cluster.engine.local_engine import LocalEngine
from coordinator.request import FinishReason
from processors import SamplingParams
from processors.builtins.thinking_budget import ThinkingBudgetStateHolder, _RowState

START, END = "<think>", "Final answer:"


def find(seq: list[int], pattern: list[int]) -> int:
    for i in range(len(seq) - len(pattern) + 1):
        if seq[i : i + len(pattern)] == pattern:
            return i
    return -1


@pytest.fixture(scope="module", params=[0, 3], ids=["no-spec", "spec3"])
def engine(request):
    config = {
        "model": {"tiny": "loopy", "max_model_len": 256},
        "scheduler": {"max_num_seqs": 8},
        "reasoning": {"start": START, "end": END},
    }
    if request.param:
        config["speculative"] = {"num_speculative_tokens": request.param, "draft_policy": "fixed"}
    return LocalEngine(config)


@pytest.mark.parametrize("budget", [0, 1, 5, 17])
def test_forced_end_after_exactly_budget_tokens(engine, budget):
    tok = engine.tokenizer
    end_ids = tok.encode(END, add_special_tokens=False)
    assert len(end_ids) > 1  # a multi-token end sequence
    prompts = ["Question: why? <think>", "a b a b a b a b <think>", "Hello <think> hmm"]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=40, ignore_eos=True, thinking_token_budget=budget)
              for i, t in enumerate([0.0, 0.0, 1.0])]
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        prompt_ids = tok(prompt)["input_ids"]
        already = len(prompt_ids) - (prompt_ids.index(4) + 1)  # thinking tokens in the prompt
        at = find(out.token_ids, end_ids)
        assert at == max(budget - already, 0), (prompt, out.token_ids)


def test_thinking_closed_in_prompt_is_not_forced(engine):
    tok = engine.tokenizer
    end_ids = tok.encode(END, add_special_tokens=False)
    closed, = engine.generate(["<think> ok " + END + " so"], SamplingParams(
        temperature=0.0, max_tokens=20, ignore_eos=True, thinking_token_budget=0))
    free, = engine.generate(["<think> ok " + END + " so"], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert closed.token_ids == free.token_ids and find(closed.token_ids, end_ids) == -1


def test_natural_end_is_respected_and_no_budget_pays_nothing(engine):
    tok = engine.tokenizer
    end_ids = tok.encode(END, add_special_tokens=False)
    # The model is pushed to write the end sequence's first token itself; the holder then
    # sees a natural end once the sequence completes and must not force anything after it.
    out, = engine.generate(["<think>"], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                       thinking_token_budget=50))
    assert find(out.token_ids, end_ids) == -1  # budget not reached: nothing forced
    free, = engine.generate(["<think>"], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    assert free.token_ids == out.token_ids


def test_budget_without_reasoning_config_is_rejected():
    engine = LocalEngine({"model": {"tiny": "default", "max_model_len": 64}})
    out, = engine.generate(["Hello"], SamplingParams(thinking_token_budget=3))
    assert out.finish_reason == FinishReason.ERROR
    assert "thinking_token_budget needs a reasoning section" in out.error


class TestHolderRules:
    """The holder's decisions as a pure function of the tokens (S = start, E1 E2 = end)."""

    S, E = [100], [201, 202]

    def forced(self, prompt, output, budget, drafts=0):
        holder = ThinkingBudgetStateHolder(self.S, self.E, 4)
        return holder.forced_token(_RowState(budget, prompt, output), drafts)

    def test_counts_from_prompt(self):
        assert self.forced([1, 100, 7, 7], [], 2) == 201
        assert self.forced([1, 100, 7], [], 2) is None
        assert self.forced([1, 100, 7, 7], [201], 2) == 202

    def test_natural_end_then_rearm(self):
        assert self.forced([100], [7, 201, 202, 7, 7, 7], 2) is None  # closed naturally
        assert self.forced([100], [7, 201, 202, 100, 7, 7], 2) == 201  # opened again: full budget again

    def test_drafts_are_scanned_but_not_cached(self):
        holder = ThinkingBudgetStateHolder(self.S, self.E, 4)
        state = _RowState(3, [100], [7, 7, 7])
        # One committed thinking token plus two drafts: the next position is the third
        # thinking token after the drafts, so the end starts right there.
        assert holder.forced_token(state, num_drafts=2) == 201
        assert state.scanned == 2  # drafts never enter the cache
        del state.output[-1]
        assert holder.forced_token(state, num_drafts=1) is None
        state.output.extend([7, 201])
        assert holder.forced_token(state) == 202


class TestTextMarker:
    """A marker matched in the decoded text: wherever its last character lands, however it is split."""

    VOCAB = {1: "Hi", 2: " <", 3: "<", 4: "think", 5: ">", 6: ">\n", 7: " ", 8: "<think>", 9: "x", 10: "</"}

    def marker(self, text="<think>"):
        from processors.markers import TextMarker

        return TextMarker(text, lambda ids: "".join(self.VOCAB[i] for i in ids))

    def test_every_spelling_is_found_at_the_token_that_completes_it(self):
        m = self.marker()
        for tokens, end in (([1, 2, 4, 5], 4), ([1, 3, 4, 5, 9], 4), ([8], 1), ([1, 7, 3, 4, 6, 9], 5)):
            assert m.last_end(tokens, 0, len(tokens)) == end, tokens
            assert m.first_end(tokens, 0) == end, tokens

    def test_last_and_first_of_several_and_ranges(self):
        m = self.marker()
        tokens = [8, 9, 2, 4, 5, 9, 8]
        assert m.last_end(tokens, 0, len(tokens)) == 7
        assert m.last_end(tokens, 0, 6) == 5 and m.last_end(tokens, 0, 4) == 1
        assert m.first_end(tokens, 1) == 5 and m.first_end(tokens, 5) == 7
        assert m.last_end(tokens, 1, 4) == -1  # the occurrence ending at 5 is outside (1, 4]
        assert m.first_end([9, 9, 3, 4], 0) == -1

    def test_holder_with_text_markers_forces_the_given_ids(self):
        start, end = self.marker(), self.marker("</think>")
        holder = ThinkingBudgetStateHolder(start, end, 4, forced_end=[10, 4, 5])
        state = _RowState(2, [1, 2, 4, 5], [9, 9])
        assert holder.forced_token(state) == 10  # two thinking tokens after " <think>": the end starts
        state.output += [10, 4]
        assert holder.forced_token(state) == 5
        state.output += [5, 9]
        assert holder.forced_token(state) is None  # closed
        with pytest.raises(ValueError, match="needs the token ids to force"):
            ThinkingBudgetStateHolder(start, end, 4)
