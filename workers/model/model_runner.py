"""Continuous-batching forward passes over a Hugging Face causal LM with a paged KV cache.

One forward per step for all of a worker's rows: every new token of the step
(decode tokens, prefill chunks, draft tokens) is packed into one sequence
``[1, N]`` with its own position and its cache slot, given by the row's block
table (decided by the coordinator). Projections and MLPs see only real
tokens; attention (``workers.model.paged_attention``) reads each row's blocks.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workers.cpu import host_memory, native_attention
from workers.cpu.cpu_fusion import fuse_cpu_layers
from workers.cpu.cpu_linear import prepack_available
from workers.cpu.row_tiles import fix_row_counts, in_tiles
from workers.model.attention_probe import verify_once
from workers.model.decode_layout import block_major_layout
from workers.host_cache import cache_root
from workers.model.lora import LoraManager
from workers.model.memory_plan import GpuMemoryPlan
from workers.model.merged_layers import merge_layers
from workers.model.model_support import check_model_config, kv_geometry, resolved_max_model_len
from workers.model.runner_config import RunnerConfig
from workers.model.runner_options import (
    default_block_size,
    resolve_dtype,
    sharded_loading,
    use_flex_attention,
    use_native_decode,
)
from workers.model.paged_attention import (
    ATTENTION_NAME,
    SHORT_QUERY_LIMIT,
    AttentionGroup,
    BlockMajorDecode,
    NativeDecode,
    PackedStep,
    PagedKVCache,
    UnsupportedAttention,
    paged_attention,
    register_paged_attention,
)
from workers.model.static_decode import StaticDecoder, decode_mode
from workers.model.tensor_parallel import shard_bytes, smallest_over_ranks
from workers.model.tiny import random_model, random_weights_seed
from workers.row_work import RowWork

logger = logging.getLogger(__name__)

INVARIANT_QUERIES_PER_ROW = 1  # batch-invariant CPU attention: each query a row of its own in the native kernel
MASK_LIMIT = 1 << 22  # rows x queries x keys of one padded prefill group (a 4 MiB boolean mask)


class ModelRunner:
    """Holds one model replica and its paged KV cache; runs packed forward passes."""

    static: StaticDecoder | None = None  # fixed-shape decode steps, once the cache exists

    def __init__(self, model_path: str | Path, device: torch.device | str, dtype: str = "auto",
                 model_config: Any = None, **settings: Any) -> None:
        """A runner from its settings given one by one (``RunnerConfig``'s fields; ``model_config`` is its
        ``hf_config``), as tests and benches build one; an engine's workers use ``from_config``."""
        self._build(RunnerConfig(str(model_path), dtype, hf_config=model_config, **settings), torch.device(device))

    @classmethod
    def from_config(cls, config: RunnerConfig, device: torch.device | str) -> ModelRunner:
        runner = cls.__new__(cls)
        runner._build(config, torch.device(device))
        return runner

    def _build(self, config: RunnerConfig, device: torch.device) -> None:
        """Load the model, size and allocate the KV cache, then fix the layers that serve."""
        register_paged_attention()
        self.device = device
        if self.device.type == "cpu":
            host_memory.keep_freed_memory()  # each step's logits and activations reuse the heap's pages
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.lora: LoraManager | None = None  # installed once the model's layers are final
        self.model = self._load(config)
        hf_config = self.model.config
        tp = config.tensor_parallel_size
        self.native_decode = use_native_decode(config.decode_attention, self.device, self.dtype)
        self.flex = use_flex_attention(config.decode_attention, self.device)
        self.batch_invariant = config.batch_invariant and self.device.type == "cpu" and tp == 1
        self.vocab_size = hf_config.vocab_size
        self.block_size = config.block_size or default_block_size(self.device, self.native_decode)
        self.num_layers, kv_heads, self.head_dim = kv_geometry(hf_config)
        self.kv_heads = kv_heads // tp  # this rank's heads
        static_mode = None if config.lora is not None else decode_mode(config.enforce_eager, self.device, tp)
        per_block = self._size_cache(config, static_mode)
        self.last_step: PackedStep | None = None
        self.cache: PagedKVCache | None = None
        if config.verify:  # before the cache: the probe has a small cache of its own, and may copy the weights
            verify_once(self, config.model_path, config.trust_remote_code)
        # One more block where a fixed-shape decode's padding rows write (no request owns it).
        pad_blocks = 1 if static_mode else 0
        self.cache = PagedKVCache(self.num_layers, self.num_blocks + config.spare_blocks + pad_blocks,
                                  self.block_size, self.kv_heads, self.head_dim, self.dtype, self.device)
        self.spare_blocks = list(range(self.num_blocks, self.num_blocks + config.spare_blocks))
        self.weight_bytes = shard_bytes(self.model)
        self.kv_bytes = (self.num_blocks + config.spare_blocks) * per_block
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB) on %s; decode attention: %s", self.num_blocks,
                    self.block_size, self.num_blocks * per_block / 2**20, self.device,
                    "native CPU kernel" if self.native_decode else "FlexAttention" if self.flex else "torch")
        self._serving_layers(config, static_mode)
        if static_mode:
            self._capture(config, static_mode)
        # What the finished runner computes for a fixed probe: an engine-wide fault found later (a step
        # that fails every request) is told from a request's own by computing it again (``self_check``).
        self._fingerprint: torch.Tensor | None = None
        if tp == 1:
            problem = self.self_check()
            if problem is not None:
                raise RuntimeError(f"the model cannot serve: {problem}")

    def _load(self, config: RunnerConfig) -> torch.nn.Module:
        """The model on the device with the paged attention: its weights, or a bench shape's random ones."""
        from transformers import AutoConfig, AutoModelForCausalLM

        hf_config = config.hf_config
        if hf_config is None:  # built on its own (tests, benches); an engine hands down the config it read
            hf_config = AutoConfig.from_pretrained(config.model_path, trust_remote_code=config.trust_remote_code)
        seed = random_weights_seed(config.model_path)
        if seed is not None:  # a bench shape (workers.model.tiny): its weights are built here, from the seed
            if config.tensor_parallel_size > 1:
                raise ValueError(f"{config.model_path} holds no weights (random weights built on each device): "
                                 "it cannot be sharded across tensor-parallel ranks")
            model = random_model(copy.deepcopy(hf_config), seed, self.dtype, self.device)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                config.model_path, config=copy.deepcopy(hf_config), dtype=self.dtype,
                trust_remote_code=config.trust_remote_code,
                **sharded_loading(hf_config, config.tensor_parallel_size))
        self.max_model_len = resolved_max_model_len(model.config, config.max_model_len)
        check_model_config(model.config, self.max_model_len)
        try:
            model.set_attn_implementation(ATTENTION_NAME)
        except Exception as exc:
            raise UnsupportedAttention(
                f"{type(model).__name__} does not accept a custom attention function ({exc})"
            ) from None
        return model.to(self.device).eval()

    def _size_cache(self, config: RunnerConfig, static_mode: str | None) -> int:
        """Set ``num_blocks`` from the budget (on a GPU without one: what is left once a step's peak is set
        aside); returns the bytes of one block."""
        per_block = PagedKVCache.bytes_per_block(self.num_layers, self.block_size, self.kv_heads, self.head_dim,
                                                 self.dtype)
        min_blocks = -(-self.max_model_len // self.block_size)  # one sequence of max_model_len
        activations = 0
        if self.device.type == "cuda" and config.kv_cache_memory is None:
            activations = self._activation_reserve(config.max_rows, config.cudagraph_capture_sizes,
                                                   static_mode == "graphs", config.max_step_tokens)
            if config.lora is not None:  # the adapters' slots, allocated once the cache is
                activations += config.lora.buffer_bytes(self.model.config, self.dtype.itemsize,
                                                        config.tensor_parallel_size)
        self.num_blocks = smallest_over_ranks(
            self._num_blocks(per_block, config.kv_cache_memory, config.gpu_memory_utilization,
                             config.max_rows * min_blocks, activations))
        if self.num_blocks < min_blocks:
            raise ValueError(
                f"KV cache budget holds {self.num_blocks} blocks of {self.block_size} tokens "
                f"({per_block} bytes each); one sequence of max_model_len={self.max_model_len} needs {min_blocks}: "
                f"max_model_len={self.num_blocks * self.block_size} would fit. Raise cache.kv_cache_memory / "
                "cache.gpu_memory_utilization or lower model.max_model_len."
            )
        return per_block

    def _serving_layers(self, config: RunnerConfig, static_mode: str | None) -> None:
        """After the load-time check: the layers as they serve. Prepacked and fused CPU layers are exact to
        rounding (fused ones bit for bit against prepacked ones). Not on a tensor-parallel shard: transformers'
        collectives hang on the linear modules that fusion would replace. The compiled fixed-shape decode traces
        the layers as a GPU runs them: no fused or prepacked CPU layers (its attention is one opaque operator)."""
        lora, tp, merge = config.lora, config.tensor_parallel_size, config.merge_projections
        cpu_fused = (config.prepack_cpu_weights and prepack_available(self.device, self.dtype) and tp == 1
                     and static_mode != "compiled" and not merge)
        if cpu_fused:
            fuse_cpu_layers(self.model, projections=lora is None, store=cache_root() / "cpu-fusion")
        if merge is None:
            merge = (self.device.type != "cpu" or static_mode == "compiled") and lora is None
        if merge and not cpu_fused and tp == 1:
            merge_layers(self.model, paged_attention)
        if self.batch_invariant:
            fix_row_counts(self.model, config.row_tile, cache_root() / "row-tiles", config.smallest_row_tile)
        if lora is not None:
            tile = config.row_tile
            tiled = (lambda compute, rows: in_tiles(compute, rows, tile)) if self.batch_invariant else None
            self.lora = LoraManager(self.model, self.model.config, self.dtype, self.device, lora, tiled)
            if self.batch_invariant:
                self.lora.check_slots(cache_root() / "row-tiles")

    def _capture(self, config: RunnerConfig, static_mode: str) -> None:
        self.static = StaticDecoder(self, static_mode, config.max_rows, config.cudagraph_capture_sizes)
        self.static.capture()
        problem = self.static.disagreement() if static_mode == "graphs" and self.static.graphs else None
        if problem is not None:  # never served wrongly: the variable-shape forward serves every step
            logger.warning("CUDA graphs not used: %s; every step runs eager", problem)
            self.static = None

    def self_check(self) -> str | None:
        """None when this runner still computes its start-up probe (a short prompt in two prefill chunks and
        a decode step, on a cache of its own: the requests' blocks are untouched) with finite logits, equal
        to what it computed at start-up to rounding; else one line saying what is wrong. The first call
        records the probe. Not on a tensor-parallel shard (its forwards need the other ranks)."""
        from workers.model.attention_probe import probe_logits

        static, self.static = self.static, None  # the eager path: graphs are bound to the requests' cache
        try:
            logits = probe_logits(self)
        except Exception as exc:  # noqa: BLE001 - any failure of the forward is the engine's here
            return f"its forward fails on a fixed probe ({type(exc).__name__}: {str(exc)[:300]})"
        finally:
            self.static = static
        if not bool(torch.isfinite(logits).all()):
            return "its logits on a fixed probe are not finite (NaN or inf)"
        if self._fingerprint is None:
            self._fingerprint = logits
            return None
        drift = float((logits - self._fingerprint).abs().max())
        if not drift <= 1e-3 * (1.0 + float(self._fingerprint.abs().max())):
            return f"its logits on a fixed probe moved by {drift:.3g} since start-up"
        return None

    def _activation_reserve(self, max_rows: int, sizes: list[int] | None, graphs: bool, max_step_tokens: int) -> int:
        """GPU memory a step may take beyond weights and KV, measured as vLLM profiles it: the peak of the
        largest variable-shape step (the token budget as one prompt chunk) and, with graphs, of the largest
        fixed-shape forward and its persistent buffers; a quarter more for the allocator's slack. Measured
        on a cache just large enough for the chunk: attention reads keys where they lie, so the peak grows
        with the step's tokens, not with rows x max_model_len."""
        chunk = max(1, min(max_step_tokens, self.max_model_len))
        blocks = -(-chunk // self.block_size) + 1
        self.cache = PagedKVCache(self.num_layers, blocks, self.block_size, self.kv_heads, self.head_dim, self.dtype,
                                  self.device)
        saved = self.num_blocks if hasattr(self, "num_blocks") else None
        self.num_blocks = blocks
        try:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            start = torch.cuda.memory_allocated(self.device)
            with torch.inference_mode():
                self.forward([RowWork(list(range(blocks - 1)), [0] * chunk, 0, 1)])
            peak = torch.cuda.max_memory_allocated(self.device) - start
            buffers = 0
            if graphs:
                before = torch.cuda.memory_allocated(self.device)
                decoder = StaticDecoder(self, "eager", max_rows, sizes)
                buffers = torch.cuda.memory_allocated(self.device) - before
                torch.cuda.reset_peak_memory_stats(self.device)
                start = torch.cuda.memory_allocated(self.device)
                decoder.inputs.fill([], decoder.sizes[-1], decoder.pad_block, self.block_size)
                with torch.inference_mode():
                    decoder._into_buffer(decoder.sizes[-1], decoder.widths[-1])
                peak = max(peak, torch.cuda.max_memory_allocated(self.device) - start)
                del decoder
        finally:
            self.cache = None
            if saved is not None:
                self.num_blocks = saved
            torch.cuda.empty_cache()
        return buffers + int(peak * 1.25)

    def copy_blocks(self, sources: list[int], targets: list[int]) -> None:
        """Every layer's K/V of blocks ``sources`` into blocks ``targets``."""
        src = torch.tensor(sources, device=self.device)
        dst = torch.tensor(targets, device=self.device)
        for pool in (*self.cache.keys, *self.cache.values):
            pool.index_copy_(0, dst, pool.index_select(0, src))

    def _num_blocks(self, per_block: int, kv_cache_memory: int | None, utilization: float, every_row_full: int,
                    graph_bytes: int = 0) -> int:
        if kv_cache_memory is not None:
            return kv_cache_memory // per_block
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            plan = GpuMemoryPlan(total, utilization, total - free, graph_bytes, per_block, self.block_size,
                                 self.max_model_len)
            logger.info("GPU memory: %s", plan.describe())
            return plan.check().num_blocks
        return every_row_full  # CPU without a budget: as much as every row at max_model_len

    # ----- packing -----

    def _pack(self, rows: list[RowWork]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PackedStep]:
        ids: list[int] = []
        positions: list[int] = []
        blocks: list[int] = []
        offsets: list[int] = []
        keep: list[int] = []
        spans: list[tuple[int, int, int]] = []  # (row index, offset in packed sequence, length)
        bs = self.block_size
        for i, row in enumerate(rows):
            n = len(row.token_ids)
            end = row.start_pos + n
            if n == 0 or row.num_logits < 1 or row.num_logits > n:
                raise ValueError(f"row {i}: {n} tokens cannot give {row.num_logits} logits")
            if end > self.max_model_len:
                raise ValueError(f"row {i} reaches position {end}, beyond max_model_len={self.max_model_len}")
            if end > len(row.block_table) * bs:
                raise ValueError(f"row {i} reaches position {end}; its {len(row.block_table)} blocks hold {len(row.block_table) * bs}")
            spans.append((i, len(ids), n))
            ids.extend(row.token_ids)
            for pos in range(row.start_pos, end):
                positions.append(pos)
                blocks.append(row.block_table[pos // bs])
                offsets.append(pos % bs)
            keep.extend(range(len(ids) - row.num_logits, len(ids)))
        device = self.device
        pos_t = torch.tensor(positions, dtype=torch.long)
        # Decode rows and draft verification rows in one group: a block read once per layer serves
        # all of its row's queries, and padding one-token rows to the longest costs only compute.
        short = [s for s in spans if s[2] <= SHORT_QUERY_LIMIT and rows[s[0]].decode]
        long_rows = [s for s in spans if not (s[2] <= SHORT_QUERY_LIMIT and rows[s[0]].decode)]
        native = None
        block_major: list[BlockMajorDecode] = []
        if self.native_decode and self.batch_invariant:
            # Every query attends in the one kernel, prompt chunks too, as a row of its own: what it computes for a
            # query then cannot depend on which queries shared its call, so neither the chunking of a prompt nor
            # the batch moves a token's bits (the kernel already gives each query the same bits in a row of many).
            piece = INVARIANT_QUERIES_PER_ROW
            short = [(i, offset + j, min(piece, n - j)) for i, offset, n in spans for j in range(0, n, piece)]
            long_rows = []
            native = self._native(rows, short, len(ids), [rows[i].start_pos + (offset - first) for (i, offset, _), first
                                                         in zip(short, self._row_offsets(short, spans))])
        elif short and self.native_decode:
            native = self._native(rows, short, len(ids))
        elif short and not self.flex:
            block_major = [self._block_major(rows, short, positions)]
        elif short:  # FlexAttention reads every row's blocks where they lie: decode rows are a group too
            long_rows = short + long_rows
            short = []
        groups: list[AttentionGroup] = []
        groups += [self._group(rows, members, pos_t) for members in self._batches(rows, long_rows)]
        step = PackedStep(
            cache=self.cache,
            write_slots=self._write_slots(blocks, offsets),
            groups=groups,
            block_major=block_major,
            native=native,
            native_writes=self.native_decode,  # _write_slots checked the slots for the kernel
            flex=self.flex,
        )
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        return input_ids, pos_t.unsqueeze(0).to(device), torch.tensor(keep, dtype=torch.long, device=device), step

    def _write_slots(self, blocks: list[int], offsets: list[int]) -> torch.Tensor:
        heads = np.arange(self.kv_heads, dtype=np.int64)
        slots = (np.asarray(blocks, dtype=np.int64)[:, None] * self.kv_heads + heads) * self.block_size
        slots += np.asarray(offsets, dtype=np.int64)[:, None]
        if slots.size and (slots.min() < 0 or slots.max() >= self.cache.num_blocks * self.kv_heads * self.block_size):
            raise ValueError("a K/V write slot is out of the cache's range")  # the native write would not check
        return torch.from_numpy(slots.reshape(-1)).to(self.device)

    def _block_major(self, rows: list[RowWork], members: list[tuple[int, int, int]],
                     positions: list[int]) -> BlockMajorDecode:
        bs = self.block_size
        tables = [rows[i].block_table[: (rows[i].start_pos + n - 1) // bs + 1] for i, _, n in members]
        return block_major_layout(tables, [positions[offset : offset + n] for _, offset, n in members],
                                  [offset for _, offset, _ in members], bs, self.cache.num_blocks, self.device)

    @staticmethod
    def _row_offsets(pieces: list[tuple[int, int, int]], spans: list[tuple[int, int, int]]) -> list[int]:
        """Each piece's row's first offset in the packed sequence."""
        first = {i: offset for i, offset, _ in spans}
        return [first[i] for i, _, _ in pieces]

    def _native(self, rows: list[RowWork], members: list[tuple[int, int, int]], num_tokens: int,
                starts: list[int] | None = None) -> NativeDecode:
        """``members``: (row, offset in the packed sequence, queries); ``starts``: each member's first query
        position (default: its row's start)."""
        bs = self.block_size
        offsets = np.fromiter((offset for _, offset, _ in members), dtype=np.int64, count=len(members))
        counts = np.fromiter((n for _, _, n in members), dtype=np.int64, count=len(members))
        starts = np.asarray(starts if starts is not None else [rows[i].start_pos for i, _, _ in members],
                            dtype=np.int64)
        needed = (starts + counts - 1) // bs + 1  # blocks up to each row's last query
        tables = np.zeros((len(members), int(needed.max())), dtype=np.int64)
        for r, (i, _, _) in enumerate(members):
            tables[r, : needed[r]] = rows[i].block_table[: needed[r]]
        column = np.arange(int(counts.max()))
        valid = column < counts[:, None]
        token_index = np.where(valid, offsets[:, None] + column, 0)
        native = NativeDecode(block_tables=torch.from_numpy(tables), token_index=torch.from_numpy(token_index),
                              query_pos=torch.from_numpy(np.where(valid, starts[:, None] + column, -1)),
                              tokens=torch.from_numpy(token_index[valid]))
        native_attention.check_indices(native.block_tables, native.token_index, native.query_pos,
                                       self.cache.num_blocks, num_tokens, bs)
        return native

    def _batches(self, rows: list[RowWork], spans: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
        """Prefill chunks (and long verification rows) in padded batches whose mask stays under
        ``MASK_LIMIT`` entries. On CPU each row alone: torch's CPU attention blocks a padded batch's
        queries by the longest row, so a row's bits would depend on its neighbours (and a row alone
        pads nothing)."""
        if self.device.type == "cpu":
            return [[span] for span in spans]
        batches: list[list[tuple[int, int, int]]] = []
        current: list[tuple[int, int, int]] = []
        queries = keys = 0
        for span in sorted(spans, key=lambda s: s[2]):
            q, k = max(queries, span[2]), max(keys, rows[span[0]].start_pos + span[2])
            if current and (len(current) + 1) * q * k > MASK_LIMIT:
                batches.append(current)
                current, q, k = [], span[2], rows[span[0]].start_pos + span[2]
            current.append(span)
            queries, keys = q, k
        return batches + ([current] if current else [])

    def _group(self, rows: list[RowWork], members: list[tuple[int, int, int]], pos_t: torch.Tensor) -> AttentionGroup:
        q_len = max(n for _, _, n in members)
        index = torch.zeros(len(members), q_len, dtype=torch.long)
        valid = torch.zeros(len(members), q_len, dtype=torch.bool)
        for r, (_, offset, n) in enumerate(members):
            index[r, :n] = torch.arange(offset, offset + n)
            valid[r, :n] = True
        query_pos = pos_t[index].masked_fill(~valid, -1)
        # Each row's blocks up to its last query, padded with block 0 (masked by position).
        needed = [(rows[i].start_pos + n - 1) // self.block_size + 1 for i, _, n in members]
        per_row = max(needed)
        table = torch.zeros(len(members), per_row, dtype=torch.long)
        for r, ((i, _, _), count) in enumerate(zip(members, needed)):
            table[r, :count] = torch.tensor(rows[i].block_table[:count], dtype=torch.long)
        device = self.device
        return AttentionGroup(
            q_len=q_len,
            tokens=index[valid].to(device),
            token_index=index.to(device),
            valid_flat=valid.flatten().nonzero(as_tuple=True)[0].to(device),
            query_pos=query_pos.to(device),
            block_index=table.flatten().to(device),
            rows=len(members),
            key_len=per_row * self.block_size,
        )

    @torch.inference_mode()
    def forward(self, rows: list[RowWork]) -> torch.Tensor:
        """Logits ``[sum(num_logits), vocab]`` as float32, rows in the given order."""
        if not rows:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        if self.lora is not None:
            self.lora.prepare([row.adapter for row in rows], [len(row.token_ids) for row in rows])
        shape = self.static.shape(rows) if self.static is not None else None
        if shape is not None:
            return self.static.forward(rows, shape)
        input_ids, position_ids, keep, step = self._pack(rows)
        self.last_step = step  # inspected by the load-time check
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=keep,
            packed_step=step,
        )
        return out.logits[0].to(torch.float32)
