"""Loading custom processors by class, FQCN and entry point; every error path's message."""

from __future__ import annotations

import textwrap

import pytest
import torch
from helpers import VOCAB, engine_config

from coordinator.schedule.persistent_batch import BatchEntry, PersistentBatch
from processors import (
    BUILTIN_LOGITS_PROCESSORS,
    LogitsProcessor,
    LogitsProcessorLoadError,
    ProcessorSpec,
    SamplingParams,
    build_logitsprocs,
    validate_logits_processors_parameters,
)
from processors.examples import DummyLogitsProcessor, WrappedPerReqLogitsProcessor

EXAMPLES = [DummyLogitsProcessor, WrappedPerReqLogitsProcessor]


def _custom(procs, cls):
    return [p for p in procs.all if type(p) is cls]


def run_rows(proc, target_rows: dict[int, int], n_rows: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Put n_rows requests in a batch (rows in target_rows enable the processor) and apply it."""
    batch = PersistentBatch(8)
    entries = [
        BatchEntry(
            f"r{i}",
            SamplingParams(extra_args={"target_token": target_rows[i]} if i in target_rows else None),
            [1, 2],
            [],
        )
        for i in range(n_rows)
    ]
    batch.update([], entries)
    proc.update_state(batch.take_update())
    logits = torch.randn(n_rows, VOCAB, generator=torch.Generator().manual_seed(0))
    return logits, proc.apply(logits.clone())


def check_only_enabled_rows_change(proc):
    targets = {1: 7, 3: 12}
    before, after = run_rows(proc, targets)
    for row in range(before.shape[0]):
        if row in targets:
            assert after[row].argmax().item() == targets[row]
            assert torch.isinf(after[row]).sum().item() == VOCAB - 1
            assert after[row, targets[row]] == before[row, targets[row]]
        else:
            assert torch.equal(after[row], before[row])


@pytest.mark.parametrize("cls", EXAMPLES)
def test_examples_load_by_class_object(cls):
    procs = build_logitsprocs(engine_config(), "cpu", False, custom=[cls])
    assert [type(p) for p in procs.all][: len(BUILTIN_LOGITS_PROCESSORS)] != []
    (proc,) = _custom(procs, cls)
    check_only_enabled_rows_change(proc)


@pytest.mark.parametrize("cls", EXAMPLES)
def test_examples_load_by_fqcn(cls):
    procs = build_logitsprocs(engine_config(), "cpu", False, custom=[f"processors.examples:{cls.__name__}"])
    (proc,) = _custom(procs, cls)
    check_only_enabled_rows_change(proc)
    with pytest.raises(ValueError, match="Expected format: '<module>:<type>'"):  # vLLM needs the ':'
        build_logitsprocs(engine_config(), "cpu", False, custom=[f"processors.examples.{cls.__name__}"])


def _install_plugin(tmp_path, monkeypatch, entry_points: str, module_source: str | None = None,
                    group_lines: str = ""):
    """A real installed distribution: a dist-info with entry_points.txt on sys.path."""
    dist = tmp_path / "raysample_test_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: raysample-test-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[raysample.logits_processors]\n{entry_points}\n{group_lines}")
    if module_source is not None:
        (tmp_path / "raysample_test_plugin.py").write_text(module_source)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_examples_load_by_entry_point(tmp_path, monkeypatch):
    _install_plugin(
        tmp_path,
        monkeypatch,
        "dummy = processors.examples:DummyLogitsProcessor\n"
        "wrapped = processors.examples:WrappedPerReqLogitsProcessor\n"
        "own = raysample_test_plugin:OwnProcessor",
        textwrap.dedent(
            """
            from processors.examples import DummyLogitsProcessor

            class OwnProcessor(DummyLogitsProcessor):
                pass
            """
        ),
    )
    procs = build_logitsprocs(engine_config(), "cpu", False)
    names = [type(p).__name__ for p in procs.all]
    assert {"DummyLogitsProcessor", "WrappedPerReqLogitsProcessor", "OwnProcessor"} <= set(names)
    # Builtins come first, then entry points.
    ordered = [type(p).__name__ for p in procs.non_argmax_invariant]
    assert ordered[:2] == ["MinTokensLogitsProcessor", "LogitBiasLogitsProcessor"]
    for cls in EXAMPLES:
        (proc,) = _custom(procs, cls)
        check_only_enabled_rows_change(proc)
    # Named both as entry point and explicitly: built once per listing, as vLLM.
    again = build_logitsprocs(engine_config(), "cpu", False, custom=[DummyLogitsProcessor])
    assert len(_custom(again, DummyLogitsProcessor)) == 2
    off = build_logitsprocs(engine_config(), "cpu", False, custom=[DummyLogitsProcessor], entry_points=False)
    assert [type(p).__name__ for p in off.all][3:] == ["DummyLogitsProcessor"]


def test_broken_entry_point_names_it(tmp_path, monkeypatch):
    _install_plugin(tmp_path, monkeypatch, "broken = raysample_no_such_module:Thing")
    with pytest.raises(RuntimeError, match="entry point 'broken'.*could not be loaded") as info:
        build_logitsprocs(engine_config(), "cpu", False)
    assert isinstance(info.value, LogitsProcessorLoadError)


@pytest.mark.parametrize(
    "item, error, message",
    [
        ("no_such_pkg.mod:Proc", RuntimeError, "module 'no_such_pkg.mod' could not be imported"),
        ("processors.examples:NoSuchClass", AttributeError, "'processors.examples' has no attribute 'NoSuchClass'"),
        ("processors.examples:DummyLogitsProcessor.inner", AttributeError, "has no attribute 'inner'"),
        ("processors.examples:logger", ValueError, "is not a class"),
        ("processors.examples:DummyPerReqLogitsProcessor", ValueError, "is not a subclass of processors.LogitsProcessor"),
        ("justaname", ValueError, r"^Invalid logits processor FQCN 'justaname'\. Expected format: '<module>:<type>'$"),
        ("processors.examples.DummyLogitsProcessor", ValueError, "^Invalid logits processor FQCN .* Expected format: "),
        ("math:gcd:extra", ValueError, r"^Invalid logits processor FQCN 'math:gcd:extra'\. Expected format: "),
        ("", ValueError, "must be a non-empty string"),
        (int, ValueError, "is not a subclass of processors.LogitsProcessor"),
        (ProcessorSpec("processors.examples:DummyLogitsProcessor", kwargs={"bogus": 1}), ValueError,
         "failed in its constructor"),
    ],
)
def test_load_errors_have_vllms_types_and_name_item_and_reason(item, error, message):
    """vLLM: RuntimeError for imports, AttributeError for a missing attribute, ValueError otherwise."""
    with pytest.raises(error, match=message) as info:
        build_logitsprocs(engine_config(), "cpu", False, custom=[item])
    assert isinstance(info.value, LogitsProcessorLoadError)


class Doubler(LogitsProcessor):
    def __init__(self, config, device, is_pin_memory):
        pass

    def is_argmax_invariant(self):
        return True

    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        return logits * 2


def test_vllm_signature_by_position_and_keyword_and_every_listing_built():
    by_position = build_logitsprocs(engine_config(), torch.device("cpu"), False, False, [Doubler, Doubler])
    by_keyword = build_logitsprocs(vllm_config=engine_config(), device=torch.device("cpu"), is_pin_memory=False,
                                   is_pooling_model=False, custom_logitsprocs=[Doubler, Doubler])
    for procs in (by_position, by_keyword):
        doublers = _custom(procs, Doubler)
        assert len(doublers) == 2  # one instance per listing, each applied
        logits = torch.ones(1, 4)
        for proc in doublers:
            logits = proc.apply(logits)
        assert torch.equal(logits, torch.full((1, 4), 4.0))


def test_pooling_models_reject_custom_processors():
    assert len(build_logitsprocs(engine_config(), "cpu", False, True)) == 0
    with pytest.raises(ValueError, match="Pooling models do not support custom logits processors"):
        build_logitsprocs(engine_config(), "cpu", False, True, [Doubler])


def test_vllm_plugin_group_is_read(tmp_path, monkeypatch):
    _install_plugin(tmp_path, monkeypatch, "", group_lines="[vllm.logits_processors]\ndoubler = test_loading:Doubler\n")
    procs = build_logitsprocs(engine_config(), "cpu", False)
    assert len(_custom(procs, Doubler)) == 1
    assert not _custom(build_logitsprocs(engine_config(), "cpu", False, entry_points=False), Doubler)


def test_processor_spec_passes_kwargs():
    from processors import LogitsProcessor

    class Scaled(LogitsProcessor):
        def __init__(self, config, device, is_pin_memory, factor: float = 1.0):
            self.factor = factor

        def is_argmax_invariant(self):
            return True

        def update_state(self, batch_update):
            pass

        def apply(self, logits):
            return logits * self.factor

    procs = build_logitsprocs(engine_config(), "cpu", False, custom=[ProcessorSpec(Scaled, {"factor": 2.0})])
    (proc,) = _custom(procs, Scaled)
    assert proc.factor == 2.0


def test_validate_params_runs_custom_validators():
    ok = SamplingParams(extra_args={"target_token": 3})
    validate_logits_processors_parameters([DummyLogitsProcessor], ok)
    with pytest.raises(ValueError, match="target_token must be a non-negative integer token id, got 'x'"):
        validate_logits_processors_parameters(
            ["processors.examples:DummyLogitsProcessor"], SamplingParams(extra_args={"target_token": "x"})
        )
    validate_logits_processors_parameters(None, ok)


def test_builtins_accept_any_duck_typed_config():
    class Sched:
        max_num_seqs = 4

    class AnyConfig:
        scheduler_config = Sched()
        speculative_config = None

    procs = build_logitsprocs(AnyConfig(), torch.device("cpu"), False)
    assert len(procs) == 3
    assert [type(p).__name__ for p in procs.argmax_invariant] == ["MinPLogitsProcessor"]


def test_an_attribute_error_inside_the_module_is_an_import_failure(tmp_path, monkeypatch):
    (tmp_path / "raysample_broken_on_import.py").write_text("import os\nos.no_such_function()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match="module 'raysample_broken_on_import' could not be imported") as info:
        build_logitsprocs(engine_config(), "cpu", False, custom=["raysample_broken_on_import:Proc"])
    assert not isinstance(info.value, AttributeError)
