"""Steps as forwards of fixed shape, so that a GPU replays them as CUDA graphs.

Every token of a step is one query row: its id, its position and its request's block table.
The rows are padded to a capture size (vLLM's: 1, 2, 4, 8, then steps of 8) and each table to a
width bucket (a power of two of blocks, up to ``max_model_len``). Each layer writes the K/V of
every row first and then attends each row over its table up to its position, so a decode token,
a draft and a prompt chunk's token are all the same kind of row. Token ids, positions, K/V
write slots and block tables live in one persistent device buffer that each step fills with a
single copy, so the same kernels serve every step of a shape:

- ``graphs`` (CUDA): each shape is captured once at start-up in one shared memory pool and
  replayed; the logits land in a persistent buffer. Any step whose tokens fit the largest size
  replays one; a larger one runs the variable-shape forward. A capture that fails leaves every
  step eager, with one line saying why.
- ``compiled`` (CPU, ``enforce_eager: false``): the same forward under
  ``torch.compile(fullgraph=True)`` with the eager backend, so the ops (and tokens) are the
  eager ones, and with the native decode-attention kernel as one opaque operator
  (``raysample::paged_decode``) where the variable-shape forward uses it; it proves the forward
  has no graph break, no host sync and no branch on a value.
  It takes one-token decode steps only, whose tokens then equal the variable-shape forward's.
- ``eager``: the fixed-shape forward as plain calls (tests, profiling), decode steps only.

Padding rows sit at position 0 of a block no request owns (the runner's padding block): they
write only there and attend only to it, and a real row's table is padded with it, masked by
position. Tensor-parallel ranks keep the variable-shape forward.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from itertools import chain
from typing import Any

import numpy as np
import torch

from workers.model.flex_paged import flex_layout
from workers.model.paged_attention import PackedStep, StaticDecode
from workers.row_work import RowWork

logger = logging.getLogger(__name__)

MODES = ("eager", "compiled", "graphs")
MAX_TOKENS = 256  # the largest default capture size


def capture_sizes(max_rows: int, sizes: Sequence[int] | None = None) -> list[int]:
    """Token counts a step is padded to: ``sizes`` if given, else vLLM's 1, 2, 4, 8, then steps of 8 up to
    ``max_rows``, and steps of 32 up to ``MAX_TOKENS`` so a step that admits short prompts beside a full
    batch of decode rows fits too."""
    if sizes:
        chosen = sorted({int(s) for s in sizes if 0 < int(s)})
        if not chosen:
            raise ValueError(f"cudagraph_capture_sizes must hold positive token counts, got {list(sizes)!r}")
        return chosen
    chosen = {s for s in (1, 2, 4, 8) if s <= max_rows} | set(range(16, max_rows + 1, 8)) | {max_rows}
    top = max(chosen)
    chosen |= set(range(top + 32 - top % 32, MAX_TOKENS + 1, 32))
    return sorted(chosen)


def table_widths(max_blocks: int) -> list[int]:
    """Block-table widths a decode step is padded to: powers of two, and ``max_blocks`` itself."""
    widths, width = [], 1
    while width < max_blocks:
        widths.append(width)
        width *= 2
    return widths + [max_blocks]


def smallest_at_least(options: Sequence[int], value: int) -> int | None:
    return next((o for o in options if o >= value), None)


def decode_mode(enforce_eager: bool | None, device: torch.device, tensor_parallel_size: int) -> str | None:
    """Which fixed-shape decode a runner uses: ``None`` keeps every step on the variable-shape forward.

    vLLM's ``enforce_eager``: unset means graphs on CUDA and eager on CPU; ``False`` on CPU asks for
    the compiled proof; ``True`` turns both off.
    """
    if enforce_eager or tensor_parallel_size > 1:
        return None
    if device.type == "cuda":
        return "graphs"
    return "compiled" if enforce_eager is False else None


class DecodeInputs:
    """The persistent int64 inputs of every fixed-shape decode forward, in one device buffer.

    Laid out for the largest shape (ids, positions, write slots, block tables); a smaller shape
    reads leading views of each, so the views a graph was captured with stay valid.
    """

    def __init__(self, max_rows: int, max_width: int, kv_heads: int, device: torch.device) -> None:
        self.max_rows, self.max_width, self.kv_heads = max_rows, max_width, kv_heads
        size = max_rows * (2 + kv_heads + max_width)
        pin = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.long, pin_memory=pin)
        self.device_buffer = torch.zeros(size, dtype=torch.long, device=device)
        self._host_views = self._split(self.host.numpy())
        self._views = self._split(self.device_buffer)
        self._copied: torch.cuda.Event | None = None  # the last copy out of the pinned buffer

    def _split(self, flat: Any) -> tuple[Any, Any, Any, Any]:
        rows, kv = self.max_rows, self.kv_heads
        ids, rest = flat[:rows], flat[rows:]
        positions, rest = rest[:rows], rest[rows:]
        slots, rest = rest[: rows * kv], rest[rows * kv :]
        return ids, positions, slots, rest.reshape(rows, self.max_width)

    def views(self, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, positions, write slots, block tables) of a shape: views of the device buffer."""
        ids, positions, slots, tables = self._views
        return ids[:rows], positions[:rows], slots[: rows * self.kv_heads], tables[:rows, :width]

    def fill(self, rows: Sequence[RowWork], size: int, pad_block: int, block_size: int) -> list[int]:
        """Write one query row per token of the step (its id, position and its request's table), then
        padding rows (position 0 of ``pad_block``), and copy them over once. Returns the query rows whose
        logits are kept: each row's last ``num_logits``, in the rows' order."""
        if self._copied is not None:  # the previous step's copy may still be queued behind the GPU's work
            self._copied.synchronize()
        ids, positions, slots, tables = self._host_views
        count = len(rows)
        lengths = np.fromiter((len(r.token_ids) for r in rows), dtype=np.int64, count=count)
        starts = np.fromiter((r.start_pos for r in rows), dtype=np.int64, count=count)
        logits = np.fromiter((r.num_logits for r in rows), dtype=np.int64, count=count)
        tokens = int(lengths.sum())
        ends = np.cumsum(lengths)
        # Whole-step array work, not a loop per row: this runs on the host before every replay.
        ids[:tokens] = np.fromiter(chain.from_iterable(r.token_ids for r in rows), dtype=np.int64, count=tokens)
        ids[tokens:size] = 0
        positions[:tokens] = np.arange(tokens) + np.repeat(starts - (ends - lengths), lengths)
        positions[tokens:size] = 0
        needed = (starts + lengths - 1) // block_size + 1
        blocks = np.fromiter(chain.from_iterable(r.block_table[:n] for r, n in zip(rows, needed.tolist())),
                             dtype=np.int64, count=int(needed.sum()))
        if blocks.size and (blocks.min() < 0 or blocks.max() >= pad_block):  # real and spare blocks lie below it
            raise ValueError("a K/V block id is out of the cache's range")
        tables[:size] = pad_block
        if count:
            width = int(needed.max())
            own = np.full((count, width), pad_block, dtype=np.int64)
            own[np.arange(width) < needed[:, None]] = blocks
            tables[:tokens, :width] = np.repeat(own, lengths, axis=0)
        kept = int(logits.sum())
        keep = (np.repeat(ends - logits, logits) + np.arange(kept) - np.repeat(np.cumsum(logits) - logits, logits))
        pos = positions[:size]
        block = tables[np.arange(size), pos // block_size]
        heads = np.arange(self.kv_heads)[:, None]  # head-major: (kv_heads, rows), as the attention writes them
        slots[: size * self.kv_heads] = ((block * self.kv_heads + heads) * block_size + pos % block_size).reshape(-1)
        self.device_buffer.copy_(self.host, non_blocking=True)
        if self.device_buffer.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return keep.tolist()


class StaticDecoder:
    """Runs a runner's one-token decode steps through fixed-shape forwards (see the module's docstring)."""

    def __init__(self, runner: Any, mode: str, max_rows: int, sizes: Sequence[int] | None = None,
                 every_step: bool | None = None) -> None:
        """``every_step``: take prompt chunks and drafts too (default: with graphs only)."""
        if mode not in MODES:
            raise ValueError(f"static decode mode must be one of {MODES}, got {mode!r}")
        self.runner = runner
        self.mode = mode
        self.every_step = mode == "graphs" if every_step is None else every_step
        self.sizes = capture_sizes(max_rows, sizes)
        self.max_blocks = -(-runner.max_model_len // runner.block_size)
        self.widths = table_widths(self.max_blocks)
        self.pad_block = runner.cache.num_blocks - 1
        self.inputs = DecodeInputs(self.sizes[-1], self.max_blocks, runner.kv_heads, runner.device)
        self.logits = torch.empty(self.sizes[-1], runner.vocab_size, dtype=runner.dtype, device=runner.device)
        # FlexAttention's map of pool blocks to table columns, refreshed inside every forward (and replay).
        self.logical = torch.zeros(runner.cache.num_blocks + 1, dtype=torch.long, device=runner.device) \
            if getattr(runner, "flex", False) else None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.compiled_graphs = 0  # graphs dynamo traced (compiled mode): one per shape met
        self._compiled = None
        if mode == "compiled":
            self._compiled = self._compile()

    # ----- which steps, which shape -----

    def shape(self, rows: Sequence[RowWork]) -> tuple[int, int] | None:
        """(padded query rows, table width) for a step this decoder runs, or None for the variable-shape path.

        Graphs take every step whose tokens fit a capture size (a prompt chunk's or a draft's tokens are
        query rows of their own, all written before any is attended); the CPU proof and eager mode take
        one-token decode steps, whose tokens then match the variable-shape forward's.
        """
        if not rows:
            return None
        block_size, limit = self.runner.block_size, self.runner.max_model_len
        tokens = last = 0
        for r in rows:
            n = len(r.token_ids)
            end = r.start_pos + n
            if not self.every_step and (not r.decode or n != 1 or r.num_logits != 1):
                return None
            if n == 0 or not 1 <= r.num_logits <= n or end > limit or end > len(r.block_table) * block_size:
                return None  # the variable-shape forward refuses it, naming what is wrong
            tokens += n
            last = max(last, end - 1)
        size = smallest_at_least(self.sizes, tokens)
        width = smallest_at_least(self.widths, last // block_size + 1)
        if size is None or width is None or (self.mode == "graphs" and (size, width) not in self.graphs):
            return None
        return size, width

    # ----- the forward of one shape -----

    def _forward_shape(self, size: int, width: int) -> torch.Tensor:
        """The model on the buffer's views for one shape; ``(size, vocab)`` logits in the model's dtype."""
        ids, positions, slots, tables = self.inputs.views(size, width)
        runner = self.runner
        flex = None
        if self.logical is not None:
            flex = flex_layout(tables, positions.view(size, 1), runner.cache.num_blocks, runner.kv_heads,
                               runner.model.config.num_attention_heads,
                               runner.block_size, self.logical)
        step = PackedStep(cache=runner.cache, write_slots=slots, groups=[],
                          static=StaticDecode(block_tables=tables, positions=positions,
                                              native=runner.native_decode, flex=flex))
        out = self.runner.model(input_ids=ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False,
                                logits_to_keep=0, packed_step=step)
        return out.logits[0]

    def _into_buffer(self, size: int, width: int) -> None:
        self.logits[:size].copy_(self._forward_shape(size, width))

    def _compile(self) -> Any:
        import torch._dynamo

        def counting_eager(graph: torch.fx.GraphModule, example_inputs: list) -> Any:
            self.compiled_graphs += 1
            return graph.forward

        # One graph per (rows, width) shape; never fall back to eager silently past dynamo's default limit.
        limit = len(self.sizes) * len(self.widths) + 8
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, limit)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, limit * 4)
        return torch.compile(self._into_buffer, fullgraph=True, dynamic=False, backend=counting_eager)

    @torch.inference_mode()
    def forward(self, rows: Sequence[RowWork], shape: tuple[int, int]) -> torch.Tensor:
        """float32 logits ``(len(rows), vocab)`` of a step that ``shape`` accepted."""
        size, width = shape
        keep = self.inputs.fill(rows, size, self.pad_block, self.runner.block_size)
        if self.mode == "graphs":
            self.graphs[shape].replay()
        elif self.mode == "compiled":
            self._compiled(size, width)
        else:
            self._into_buffer(size, width)
        # Always a copy: the buffer is the next forward's output, and a forward launched ahead may run
        # before these logits are sampled.
        if keep[-1] == len(keep) - 1:  # one logit per token: the leading rows
            return self.logits[: len(keep)].to(torch.float32, copy=True)
        return self.logits[torch.tensor(keep, device=self.logits.device)].to(torch.float32)

    @torch.inference_mode()
    def disagreement(self) -> str | None:
        """None when a decode step through this decoder gives the variable-shape forward's logits (to the
        dtype's rounding), else how far apart they are. Checked once after capture, on blocks no request
        holds yet: a probe prompt prefilled by the variable-shape forward, then its next token both ways."""
        runner = self.runner
        generator = torch.Generator().manual_seed(4321)
        length = 3 * runner.block_size + 5
        tokens = torch.randint(0, runner.vocab_size, (length,), generator=generator).tolist()
        blocks = -(-length // runner.block_size)
        if blocks >= self.pad_block or length > runner.max_model_len:
            return None  # a cache too small to check beside the padding block
        table = list(range(blocks))
        work = [RowWork(table, tokens[-1:], length - 1, 1, decode=True)]
        shape = self.shape(work)
        if shape is None:
            return None
        static, runner.static = runner.static, None
        try:
            runner.forward([RowWork(table, tokens[:-1], 0, 1)])
            want = runner.forward(work)
        finally:
            runner.static = static
        got = self.forward(work, shape)
        scale = 1.0 + float(want.abs().max())
        distance = float((got - want).abs().max())
        tolerance = (1e-4 if runner.dtype == torch.float32 else 2e-2) * scale
        if distance <= tolerance:
            return None
        return f"a decode step's logits differ from the variable-shape forward's by {distance:.3g} (tolerance {tolerance:.3g})"

    # ----- CUDA graphs -----

    @torch.inference_mode()
    def capture(self) -> bool:
        """Capture every shape (largest first, one shared pool). On failure: no graphs, one warning, False."""
        if self.mode != "graphs":
            return True
        device = self.runner.device
        try:
            pool = torch.cuda.graph_pool_handle()
            for size in reversed(self.sizes):
                for width in reversed(self.widths):
                    self.inputs.fill([], size, self.pad_block, self.runner.block_size)
                    self._into_buffer(size, width)  # warm-up: library handles and workspaces outside capture
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._into_buffer(size, width)
                    self.graphs[(size, width)] = graph
            torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 - any failure leaves the engine eager, never down
            self.graphs.clear()
            logger.warning("CUDA graph capture failed (%s: %s); decode steps run eager (model.enforce_eager: true "
                           "silences this)", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return False
        logger.info("captured %d CUDA graphs of the decode step (%d row counts x %d table widths)",
                    len(self.graphs), len(self.sizes), len(self.widths))
        return True
