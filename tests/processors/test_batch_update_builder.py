import pytest
from helpers import engine_config

from processors import BatchUpdateBuilder, LogitBiasLogitsProcessor, LogitsProcessors, MinPLogitsProcessor


def test_removed_sorted_descending_pop_and_peek_lowest():
    b = BatchUpdateBuilder()
    for i in (5, 1, 3):
        b.removed_append(i)
    assert b.batch_changed
    assert b.peek_removed() == 1
    assert b.removed == [5, 3, 1]
    assert b.pop_removed() == 1 and b.pop_removed() == 3
    with pytest.raises(RuntimeError, match="after self.removed has been read"):
        b.removed_append(7)


def test_get_and_reset_none_when_nothing_changed_and_fresh_lists_after():
    b = BatchUpdateBuilder()
    assert b.get_and_reset(0) is None
    b.removed_append(2)
    update = b.get_and_reset(2)
    assert update is not None and list(update.removed) == [2] and update.batch_size == 2
    b.removed_append(0)  # allowed again after a reset
    assert list(update.removed) == [2]
    assert b.reset() is True and b.get_and_reset(1) is None


def test_logits_processors_split_by_argmax_invariance():
    cfg = engine_config(4)
    min_p, bias = MinPLogitsProcessor(cfg, "cpu", False), LogitBiasLogitsProcessor(cfg, "cpu", False)
    procs = LogitsProcessors([bias, min_p])
    assert procs.argmax_invariant == [min_p] and procs.non_argmax_invariant == [bias]
    assert list(procs.all) == [min_p, bias]
