"""A seeded request's bits never depend on its batch, its prompt's chunking, a preemption or a restart:
by construction (every CPU linear called with one fixed row count, ``workers/cpu/row_tiles.py``; every
query attended as a row of its own in the native kernel), proven with fake kernels worse than any real
CPU's, so that no particular machine is needed (none here has AMX):

- a fake linear whose bits change at every row count of a call, and, for the rows past the call's last
  whole block of 8, with the row's position (as kernels treat a tail);
- a fake attention whose bits change with how a row's queries were grouped into the call (how many, and
  which of them), which is what a prompt's chunking changes.

With both, 12 requests alone give their tokens and logprob bits from a batch of 48 that chunks their
prompts, preempts them and restarts them; with the construction switched off, they do not.
"""

from __future__ import annotations

import pytest
import torch

from cluster.engine.local_engine import LocalEngine
from processors import SamplingParams
from workers.cpu.cpu_linear import PrepackedLinear
from workers.model import paged_attention

TILE = 16


def exact_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Each row's product on its own, in float64 (the same bits at any row count), in the input's dtype."""
    out = (x.double().unsqueeze(1) * weight.double().unsqueeze(0)).sum(-1)
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)


def relative(dtype: torch.dtype) -> float:
    """A nudge that moves the last bits of either dtype, small enough for the load-time attention probe."""
    return 2.0**-20 if dtype == torch.float32 else 2.0**-8


class FakeKernels:
    """Installs both fakes; ``row_counts`` records every linear call's rows. ``agree_at``: row counts at which
    the fake linear gives the tile's bits (a kernel that the row ladder may use there); at every other count
    its bits move. Verdicts are not kept on disk (the real kernels' would not describe the fakes)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, agree_at: tuple[int, ...] = ()) -> None:
        from workers.cpu import row_tiles

        self.row_counts: set[int] = set()
        fakes = self
        same = {TILE, *agree_at}

        def compute(self: PrepackedLinear, flat: torch.Tensor) -> torch.Tensor:
            weight = self.__dict__.get("_dense")
            if weight is None:
                weight = self.__dict__["_dense"] = self.packed_weight.to_dense()
            rows = flat.shape[0]
            fakes.row_counts.add(rows)
            out = exact_rows(flat, weight, self.bias).float()
            eps = relative(flat.dtype)
            count = TILE if rows in same else rows
            factor = torch.full((rows, 1), 1 + eps * ((count * 7919) % 5 + 1))  # another at every other row count
            tail = torch.arange(rows) >= rows - rows % 8
            factor[tail] *= 1 + eps * (torch.arange(rows)[tail].unsqueeze(1) % 3 + 1)
            return (out * factor).to(flat.dtype)

        real_attention = paged_attention.native_paged_decode

        def attention(q_all, out, k_pool, v_pool, tables, token_index, query_pos, *args, **kwargs):
            real_attention(q_all, out, k_pool, v_pool, tables, token_index, query_pos, *args, **kwargs)
            valid = query_pos >= 0
            count = valid.sum(dim=1, keepdim=True).expand_as(valid)  # the queries of each row of the call
            which = torch.arange(valid.shape[1]).expand_as(valid)
            factor = 1 + relative(out.dtype) * ((count * 13 + which * 5) % 4).float()
            tokens = token_index[valid]
            out[tokens] = (out[tokens].float() * factor[valid].view(-1, 1, 1)).to(out.dtype)

        monkeypatch.setattr(PrepackedLinear, "compute", compute)
        monkeypatch.setattr(paged_attention, "native_paged_decode", attention)
        monkeypatch.setattr(row_tiles, "_checked", lambda store, key, check: check())


def prompts() -> list[list[int]]:
    """48 prompts of 5 to 70 tokens; the first 12 are the ones checked."""
    return [[(7 * i + 3 * j) % 400 + 5 for j in range(5 + (i * 13) % 66)] for i in range(48)]


def params(i: int) -> SamplingParams:
    seeded = i % 2 == 0
    return SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2, temperature=0.9 if seeded else 0.0,
                          seed=i if seeded else None, top_p=0.95 if seeded else 1.0)


def engine(dtype: str, invariant: bool, smallest: int = 8) -> LocalEngine:
    """A token budget of 48 (every long prompt is chunked, at other places alone and batched), 48 rows over a
    KV cache of 40 blocks, a fifth of what they need at their longest (preemption). ``smallest``: the row
    ladder's smallest size (TILE / 2 = 8 by default: the fakes reject it unless they agree there)."""
    block_bytes = 2 * 2 * 16 * 2 * 16 * (4 if dtype == "float32" else 2)  # K and V, 2 layers, 2 KV heads of 16
    return LocalEngine({"model": {"tiny": "default", "dtype": dtype, "max_model_len": 128,
                                  "batch_invariant": invariant, "cpu_row_tile": TILE,
                                  "cpu_smallest_row_tile": smallest},
                        "scheduler": {"max_num_seqs": 48, "max_num_batched_tokens": 48},
                        "cache": {"block_size": 16, "kv_cache_memory": 40 * block_bytes}})


def record(out) -> tuple:
    return tuple(out.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in d.items()))
                                       for d in out.outputs[0].logprobs)


def batched_with_a_restart(eng: LocalEngine) -> list[tuple]:
    """The 48 requests together; after 6 steps every running request is re-admitted with the tokens it has
    (what a lost worker causes: its K/V recomputed), and the engine goes on."""
    ids = eng.submit_many(prompts(), [params(i) for i in range(48)], final_only=True)
    for _ in range(6):
        eng.step()
    eng.coordinator.requeue_running(eng.executor.worker_ids)
    eng.executor.reset()
    outputs = eng.results(ids)
    return [record(outputs[rid]) for rid in ids[:12]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_alone_equals_batched_chunked_preempted_and_restarted_with_kernels_worse_than_any_cpu(dtype, monkeypatch):
    fakes = FakeKernels(monkeypatch)
    eng = engine(dtype, invariant=True)
    fakes.row_counts.clear()  # the load-time checks called the linears as they are: serving starts here
    try:
        batched = batched_with_a_restart(eng)
        assert eng.coordinator.scheduler.num_preemptions > 0  # the batch of 48 did not fit the KV cache
        alone = [record(eng.generate([p], params(i))[0]) for i, p in enumerate(prompts()[:12])]
    finally:
        eng.shutdown()
    assert alone == batched
    assert fakes.row_counts == {TILE}  # every CPU linear call the runner issued had the fixed row count


def test_short_calls_take_only_the_ladder_sizes_whose_kernel_gives_the_tiles_bits(monkeypatch):
    """A fake linear that gives the tile's bits at 8 rows and other bits at every other count (4 included):
    the load-time check keeps 8 and drops 4 and 12 from the ladder (4, 8, 12), short calls take 8 rows, and the
    requests still keep their bits alone and batched, chunked, preempted and restarted."""
    fakes = FakeKernels(monkeypatch, agree_at=(8,))
    eng = engine("float32", invariant=True, smallest=4)
    fakes.row_counts.clear()
    try:
        batched = batched_with_a_restart(eng)
        alone = [record(eng.generate([p], params(i))[0]) for i, p in enumerate(prompts()[:12])]
    finally:
        eng.shutdown()
    assert alone == batched
    assert fakes.row_counts == {8, TILE}  # every call 16 rows or, for a short one, 8


def test_with_the_construction_switched_off_the_fakes_move_the_bits(monkeypatch):
    """The test above is sensitive: without fixed row counts and per-query attention the same requests
    do not keep their bits (the fake linear alone already moves them)."""
    FakeKernels(monkeypatch)
    eng = engine("float32", invariant=False)
    try:
        batched = batched_with_a_restart(eng)
        alone = [record(eng.generate([p], params(i))[0]) for i, p in enumerate(prompts()[:12])]
    finally:
        eng.shutdown()
    assert sum(a != b for a, b in zip(alone, batched)) >= 6


def test_attention_grouped_by_chunk_would_move_the_bits(monkeypatch):
    """With the linears fixed but a row's queries attended in groups (as a prompt's chunk), the fake attention
    alone moves the bits: attending every query as its own row is part of the construction."""
    import workers.model.model_runner as model_runner

    FakeKernels(monkeypatch)
    monkeypatch.setattr(model_runner, "INVARIANT_QUERIES_PER_ROW", 16)
    eng = engine("float32", invariant=True)
    try:
        batched = batched_with_a_restart(eng)
        alone = [record(eng.generate([p], params(i))[0]) for i, p in enumerate(prompts()[:12])]
    finally:
        eng.shutdown()
    assert any(a != b for a, b in zip(alone, batched))


def test_a_single_cpu_workers_steps_are_multiples_of_the_row_count_while_prompts_can_fill_them():
    """Rows past the last multiple of the linears' call sizes (here 8 and 16: the row ladder's step is 8) would
    be padding (wasted compute): while more requests wait than a step has free rows for, the scheduler sizes
    each step to a multiple of it (32 rows of one token each are one too), and chunking moves no bits. The
    last prompts are finished at once, and the draining rows are what they are."""
    eng = LocalEngine({"model": {"tiny": "default", "max_model_len": 128, "cpu_row_tile": TILE},
                       "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 100}})
    sizes: list[tuple[int, int]] = []
    launch = eng.executor.launch

    def recorded(plan):
        stayed = len(plan.num_tokens) - (len(plan.update.added) if plan.update is not None else 0)
        sizes.append((int(plan.num_tokens.sum()), waiting_before[-1] > 32 - stayed))
        return launch(plan)

    waiting_before = [0]
    next_plan = eng.coordinator.next_plan

    def planned():
        waiting_before.append(eng.coordinator.num_waiting())
        return next_plan()

    eng.coordinator.next_plan = planned

    eng.executor.launch = recorded
    try:
        outs = eng.generate(prompts(), [params(i) for i in range(48)])
    finally:
        eng.shutdown()
    assert all(o.error is None for o in outs)
    with_backlog = [tokens for tokens, backlog in sizes if backlog]
    assert len(with_backlog) > 10 and all(tokens % 8 == 0 for tokens in with_backlog), with_backlog
    assert any(tokens % TILE for tokens in with_backlog)  # a multiple of 8, not only of the tile


class FakeLoraProducts:
    """The LoRA products' matmul, worse than any CPU: its bits change with the call's row count and with an
    output column's position (where a slot sits in the stacked weights). Verdicts are not kept on disk."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from types import SimpleNamespace

        import workers.model.lora as lora
        from workers.cpu import row_tiles

        self.row_counts: set[int] = set()
        fakes = self

        def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            rows, cols = x.shape[0], weight.shape[0]
            fakes.row_counts.add(rows)
            eps = relative(x.dtype)
            factor = (1 + eps * ((rows * 7919) % 5 + 1)) * (1 + eps * (torch.arange(cols) % 3 + 1).float())
            return (exact_rows(x, weight, None).float() * factor).to(x.dtype)

        monkeypatch.setattr(lora, "F", SimpleNamespace(linear=linear))
        monkeypatch.setattr(row_tiles, "checked_once", lambda store, shape, check, tile=TILE: check())


def test_lora_rows_keep_their_bits_alone_and_batched_with_kernels_worse_than_any_cpu(monkeypatch, tmp_path):
    """Two adapters and the base model in the batch of 48 (chunked, preempted, restarted): each checked request
    gives the bits it gives alone. The fake moves a slot's bits with its place, so the load-time check sends
    every slot to products of its own; the fixed row tiles cover the rest."""
    from adapters import build_adapter

    from cluster.config import resolve
    from cluster.engine.prompts import with_lora
    from processors import LoRARequest

    path = resolve({"model": {"tiny": "default"}}).facts.path
    adapters = [LoRARequest(f"a{i}", i + 1, str(build_adapter(path, tmp_path / f"a{i}", kind, i)))
                for i, kind in enumerate(("all-r16", "qko-r2"))]
    loras = [adapters[i % 3] if i % 3 < 2 else None for i in range(48)]
    FakeKernels(monkeypatch)
    lora_fakes = FakeLoraProducts(monkeypatch)
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    eng = LocalEngine({"model": {"tiny": "default", "dtype": "float32", "max_model_len": 128, "cpu_row_tile": TILE},
                       "scheduler": {"max_num_seqs": 48, "max_num_batched_tokens": 48},
                       "cache": {"block_size": 16, "kv_cache_memory": 40 * block_bytes},
                       "lora": {"enabled": True, "max_loras": 2}})
    try:
        assert eng.workers[0].runner.lora.per_slot  # the check found the fake's columns move with their slot
        lora_fakes.row_counts.clear()
        ids = eng.submit_many(prompts(), with_lora([params(i) for i in range(48)], loras, 48), final_only=True)
        for _ in range(6):
            eng.step()
        eng.coordinator.requeue_running(eng.executor.worker_ids)
        eng.executor.reset()
        outputs = eng.results(ids)
        batched = [record(outputs[rid]) for rid in ids[:12]]
        assert eng.coordinator.scheduler.num_preemptions > 0
        alone = [record(eng.generate([p], params(i), lora_request=loras[i])[0]) for i, p in enumerate(prompts()[:12])]
    finally:
        eng.shutdown()
    assert alone == batched
    assert lora_fakes.row_counts == {TILE}
