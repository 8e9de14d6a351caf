"""Structured outputs (xgrammar) as a processor: valid outputs, sharded, exact under spec decode."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from cluster.engine.local_engine import LocalEngine
from processors import SamplingParams

pytestmark = pytest.mark.long  # over half a minute: scheduled early (tests/conftest.py)

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["cat", "dog", "fox"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 1, "maximum": 99},
                                                   "vip": {"type": "boolean"}},
                  "required": ["age", "vip"], "additionalProperties": False},
    },
    "required": ["id", "kind", "tags", "owner"],
    "additionalProperties": False,
}
CHOICES = ["yes", "no", "maybe later"]
REGEX = r"[A-Z][a-z]{2,5}-[0-9]{2}"
PROMPTS = ["Hello there", "The quick brown fox", "café 你好", "Numbers like 0 1 2 3", "a b c a b c", "Think first",
           "Unicode matters", "batch"]


def constraint(i: int) -> dict | None:
    return [{"json": SCHEMA, "disable_any_whitespace": True}, {"choice": CHOICES}, {"regex": REGEX}, None][i % 4]


def params(i: int, greedy: bool) -> SamplingParams:
    sampling = {"temperature": 0.0} if greedy else {"temperature": 0.9, "seed": i}
    return SamplingParams(max_tokens=200, structured_outputs=constraint(i), **sampling)


def check(i: int, out) -> None:
    assert out.error is None, out.error
    kind = constraint(i)
    if kind is None:
        return
    assert out.finish_reason == "stop", (i, out.text)  # every constraint here is a finite language
    if "json" in kind:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    elif "choice" in kind:
        assert out.text in CHOICES
    else:
        assert re.fullmatch(REGEX, out.text), out.text


def engine(workers: int = 1, spec: int = 0, **extra) -> LocalEngine:
    config = {"model": {"tiny": "loopy", "max_model_len": 256},
              "scheduler": {"max_num_seqs": 4, "consistency_check_every": 1}, "cluster": {"num_workers": workers},
              **extra}
    if spec:
        config["speculative"] = {"num_speculative_tokens": spec, "draft_policy": "fixed"}
    return LocalEngine(config)


@pytest.mark.parametrize("greedy", [True, False])
def test_outputs_satisfy_their_constraint_sharded_and_with_spec(greedy):
    batch = [params(i, greedy) for i in range(len(PROMPTS))]
    reference = engine().generate(PROMPTS, batch)
    for i, out in enumerate(reference):
        check(i, out)
    for workers, spec in ((2, 0), (2, 3)):
        outs = engine(workers, spec).generate(PROMPTS, batch)
        assert [o.token_ids for o in outs] == [o.token_ids for o in reference], (workers, spec)


def test_churn_of_constrained_and_free_requests_keeps_replicas_identical():
    eng = engine(2, spec=2)
    rng = random.Random(5)
    pending = list(range(24))
    finished = {}
    ids = {}
    while pending or eng.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                i = pending.pop(0)
                ids[eng.add_request(PROMPTS[i % len(PROMPTS)], params(i, greedy=i % 3 == 0))] = i
        for out in eng.step():  # the audit compares every replica's matcher state every step
            if out.finished:
                finished[ids[out.request_id]] = out
    for i, out in finished.items():
        check(i, out)
    assert len(finished) == 24


def test_length_before_the_grammar_ends_says_length():
    out = engine().generate("x", SamplingParams(temperature=0.0, max_tokens=3, structured_outputs={"json": SCHEMA}))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


@pytest.mark.parametrize(("bad", "field"), [
    ({"regex": "(unclosed"}, "structured_outputs.regex"),
    ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "structured_outputs.json"),
    ({"grammar": "root ::= missing_rule"}, "structured_outputs.grammar"),
])
def test_a_bad_constraint_fails_only_its_request(bad, field):
    outs = engine().generate(["x", "y"], [SamplingParams(max_tokens=4, structured_outputs=bad),
                                          SamplingParams(max_tokens=4)])
    assert outs[0].error and field in outs[0].error
    assert outs[1].error is None and len(outs[1].token_ids) == 4


def test_aliases_and_validation():
    assert SamplingParams.from_dict({"guided_regex": "a+"}).structured_outputs.regex == "a+"
    assert SamplingParams.from_dict({"guided_json": SCHEMA}).structured_outputs.json == SCHEMA
    with pytest.raises(ValueError, match="exactly one of"):
        SamplingParams.from_dict({"structured_outputs": {"regex": "a", "choice": ["b"]}})
    with pytest.raises(ValueError, match="whitespace_pattern is not supported"):
        SamplingParams.from_dict({"guided_choice": ["a"], "guided_whitespace_pattern": " "})


def test_with_reasoning_the_constraint_starts_after_thinking():
    eng = engine(reasoning={"start": "<think>", "end": "</think>"})
    out = eng.generate("Question: yes or no? <think>", SamplingParams(
        temperature=0.0, max_tokens=40, thinking_token_budget=4, structured_outputs={"choice": CHOICES}))[0]
    end = eng.tokenizer.convert_tokens_to_ids("</think>")
    assert end in out.token_ids, out.token_ids
    thinking, answer = out.token_ids[: out.token_ids.index(end)], out.token_ids[out.token_ids.index(end) + 1 :]
    assert out.finish_reason == "stop" and len(thinking) == 4  # free tokens while thinking, then the end
    assert eng.tokenizer.decode(answer, skip_special_tokens=True) in CHOICES, out.text


def nested_schema(depth: int) -> dict:
    """A schema whose compile time grows with the cube of its depth (400 levels: 89 s on the real vocabulary)."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_a_constraint_past_the_compile_bound_fails_alone_and_holds_nothing_back():
    """A schema still compiling after structured_outputs.compile_timeout_s fails its request with the reason;
    a constraint and a free request sent after it finish while it compiles; the same schema is refused again."""
    # 4 s leaves the other two requests room on a loaded machine (two test workers on two cores); the slow
    # schema compiles for far longer (400 levels: 10-14 s on the tiny vocabulary here) and is stopped at 4 s.
    eng = engine(structured_outputs={"compile_timeout_s": 4.0})
    slow = SamplingParams(temperature=0.0, max_tokens=10, structured_outputs={"json": nested_schema(400)})
    slow_id = eng.add_request("x", slow)
    choice_id = eng.add_request("y", SamplingParams(temperature=0.0, max_tokens=10, structured_outputs={"choice": CHOICES}))
    free_id = eng.add_request("z", SamplingParams(temperature=0.0, max_tokens=5))
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done.setdefault(out.request_id, (out, len(done)))
    (slow_out, slow_rank), (choice_out, choice_rank), (free_out, _) = done[slow_id], done[choice_id], done[free_id]
    assert slow_out.error == ("structured_outputs.json took more than 4s to compile "
                              "(structured_outputs.compile_timeout_s); its compilation was stopped")
    assert choice_out.error is None and choice_out.outputs[0].text in CHOICES and free_out.error is None
    assert choice_rank < slow_rank  # compiled on a second child while the first was busy
    again = eng.generate("x", slow)[0]
    assert again.error == slow_out.error


def test_a_constraint_past_the_memory_bound_fails_alone():
    eng = engine(structured_outputs={"compile_max_memory": "1MiB", "compile_timeout_s": 60})
    outs = eng.generate(["x", "y"], [SamplingParams(max_tokens=4, structured_outputs={"json": nested_schema(120)}),
                                     SamplingParams(temperature=0.0, max_tokens=3)])
    assert outs[0].error == ("structured_outputs.json needed more than 1 MiB to compile "
                             "(structured_outputs.compile_max_memory); its compilation was stopped"), outs[0].error
    assert outs[1].error is None


def test_structural_tag_in_vllms_format_and_yaml_defaults():
    tag = json.dumps({"type": "structural_tag", "triggers": ["<a>"], "structures": [
        {"begin": "<a>", "schema": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
         "end": "</a>"}]})
    eng = engine(defaults={"guided_choice": CHOICES, "max_tokens": 30, "temperature": 0.0})
    assert eng.generate("anything")[0].text in CHOICES  # a constraint from the config's defaults
    out = eng.generate("x <a>", SamplingParams(max_tokens=20, structured_outputs={"structural_tag": tag}))[0]
    assert out.error is None and len(out.token_ids) > 0
    if "<a>" in out.text:  # text after a trigger follows the tag's schema
        body = out.text.split("<a>", 1)[1]
        if "</a>" in body:
            assert isinstance(json.loads(body.split("</a>", 1)[0])["x"], int)


def test_an_orphaned_compile_ends_itself_at_its_cpu_bound():
    """A coordinator killed mid-compile leaves its compiler child alone with the schema: the child's own CPU
    bound (set before each compile) ends it, rather than an 89-second compile running on."""
    from transformers import AutoTokenizer

    from coordinator.intake.grammar_check import Child, ChildPool
    from workers.model.tiny import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model("loopy"))
    child = Child.start(ChildPool.for_tokenizer(tokenizer, len(tokenizer)).info_json)
    child.conn.send(({"json": json.dumps(nested_schema(450))}, 2.0))
    child.conn.close()  # the parent is gone
    assert child.proc.wait(timeout=60) == -24  # SIGXCPU: its CPU bound ended it, not the compile's end
