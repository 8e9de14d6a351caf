"""Our CPU decode-attention kernel beside torch's maintained attention ops, on the same keys and values.

Issue 57 asks whether a maintained library reads a decode step's K/V as fast as the native kernel
(``workers/cpu/native/paged_decode.cpp``); where one does, the engine should use it. One decode query
per row, ``--rows`` rows at ``--position``, SmolLM2-135M's shapes by default (9 query heads over 3 KV
heads of 64), ``--layers`` layers, each with its own pool so that the keys and values come from
memory as in a step. Each row's blocks are scattered over the pool, as an engine's free list leaves
them. Timed, alternating, medians, each as a ratio to the kernel:

- **native kernel**: ``workers.cpu.native_attention.paged_decode`` on the paged pool, in place;
- **FlexAttention, paged**: ``torch.compile(flex_attention)`` on the same pages in torch's own paged
  layout (``torch.nn.attention.experimental._paged_attention.PagedAttention``: one cache of
  ``(1, kv_heads, pages * block, dim)`` and a block mask converted through the page table): how
  FlexAttention reads a paged cache;
- **FlexAttention, dense** and **SDPA, dense** (``F.scaled_dot_product_attention``, torch's CPU flash
  attention): each row's keys and values already copied into a dense ``(rows, kv_heads, position + 1,
  dim)`` tensor. The best case for both; an engine with a paged cache would pay the copy each layer,
  which is timed on its own line.

The memory speed beside them is a streaming read measured in the same run (``bench/cpu_ops.py``'s).
Each output's largest error against a float64 reference is printed beside its time. In bfloat16 the
kernel's is the larger by design: it rounds scores and probabilities to bfloat16 where transformers'
eager attention (the models' reference) rounds them; SDPA and FlexAttention keep them in float32.

    python bench/attention_libraries.py [--dtype bfloat16] [--rows 64] [--position 200] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention.experimental._paged_attention import PagedAttention  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402

from cpu_ops import read_bandwidth  # noqa: E402
from workers.cpu import native_attention  # noqa: E402


class DecodeCase:
    """One decode query per row over ``layers`` layers' K/V, held in each layout the contenders read."""

    def __init__(self, rows: int, position: int, heads: int, kv_heads: int, dim: int, block: int, layers: int,
                 dtype: torch.dtype) -> None:
        self.rows, self.heads, self.kv_heads, self.dim, self.layers = rows, heads, kv_heads, dim, layers
        self.keys = position + 1  # the past and the query's own
        per_row = -(-self.keys // block)
        pages = rows * per_row
        generator = torch.Generator().manual_seed(0)
        self.paging = PagedAttention(pages, block, rows, device="cpu")
        self.paging.empty_pages = torch.randperm(pages, generator=generator).tolist()  # scattered blocks
        for row in range(rows):
            self.paging.reserve(torch.tensor(row), torch.tensor(self.keys))
        self.table = self.paging.page_table[:, :per_row].contiguous()
        sees = position  # the query's position: it sees keys 0..position

        def causal(b, h, q, kv):
            return kv <= sees

        logical = create_block_mask(causal, rows, None, 1, per_row * block, device="cpu", BLOCK_SIZE=block)
        self.paged_mask = self.paging.convert_logical_block_mask(logical)
        self.token_index = torch.arange(rows, dtype=torch.int64).view(rows, 1).contiguous()
        self.query_pos = torch.full((rows, 1), position, dtype=torch.int64)
        self.scale = dim ** -0.5
        self.queries = [torch.randn(rows, heads, dim, generator=generator).to(dtype) for _ in range(layers)]
        # torch's paged layout (1, kv_heads, pages * block, dim); ours (pages, kv_heads, block, dim), same values.
        self.flat = [tuple(torch.randn(1, kv_heads, pages * block, dim, generator=generator).to(dtype)
                           for _ in range(2)) for _ in range(layers)]
        self.pools = [tuple(c.view(kv_heads, pages, block, dim).transpose(0, 1).contiguous() for c in kv)
                      for kv in self.flat]
        self.dense = [tuple(self.gather(pool) for pool in kv) for kv in self.pools]
        self.out = torch.empty(rows, heads, dim, dtype=dtype)
        native_attention.check_indices(self.table, self.token_index, self.query_pos, pages, rows, block)

    def gather(self, pool: torch.Tensor) -> torch.Tensor:
        """Each row's keys (or values) in order, from its blocks: ``(rows, kv_heads, keys, dim)``."""
        blocks = pool[self.table]  # (rows, per_row, kv_heads, block, dim)
        rows, per_row, kv_heads, block, dim = blocks.shape
        return blocks.transpose(1, 2).reshape(rows, kv_heads, per_row * block, dim)[:, :, : self.keys].contiguous()

    def native(self, layer: int) -> torch.Tensor:
        k, v = self.pools[layer]
        native_attention.paged_decode(self.queries[layer], self.out, k, v, self.table, self.token_index,
                                      self.query_pos, self.scale, None, None, None, indices_checked=True)
        return self.out

    def reference(self, layer: int) -> torch.Tensor:
        q = self.queries[layer].double().unsqueeze(2)
        k, v = (x.double() for x in self.dense[layer])
        return F.scaled_dot_product_attention(q, k, v, scale=self.scale, enable_gqa=True).squeeze(2)


def contenders(case: DecodeCase) -> dict[str, Callable[[int], torch.Tensor]]:
    flex = torch.compile(flex_attention, dynamic=False)
    rows, heads, dim = case.rows, case.heads, case.dim

    def flex_paged(layer: int) -> torch.Tensor:
        k, v = case.flat[layer]
        q = case.queries[layer].view(rows, heads, 1, dim)
        return flex(q, k, v, block_mask=case.paged_mask, scale=case.scale, enable_gqa=True).view(rows, heads, dim)

    def flex_dense(layer: int) -> torch.Tensor:
        k, v = case.dense[layer]
        q = case.queries[layer].view(rows, heads, 1, dim)
        return flex(q, k, v, scale=case.scale, enable_gqa=True).view(rows, heads, dim)

    def sdpa_dense(layer: int) -> torch.Tensor:
        k, v = case.dense[layer]
        q = case.queries[layer].view(rows, heads, 1, dim)
        return F.scaled_dot_product_attention(q, k, v, scale=case.scale, enable_gqa=True).view(rows, heads, dim)

    def gather_only(layer: int) -> torch.Tensor:
        k, v = case.pools[layer]
        case.gather(k), case.gather(v)
        return case.out

    return {"native kernel": case.native, "FlexAttention, paged": flex_paged, "FlexAttention, dense": flex_dense,
            "SDPA, dense": sdpa_dense, "the dense copy alone": gather_only}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--position", type=int, default=200)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=16, help="tokens a KV block (the engine's default)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if not native_attention.available():
        sys.exit("the native decode-attention kernel did not build here: nothing to compare")
    dtype = getattr(torch, args.dtype)
    case = DecodeCase(args.rows, args.position, args.heads, args.kv_heads, args.head_dim, args.block, args.layers,
                      dtype)
    runs = contenders(case)
    kv_bytes = 2 * args.rows * args.kv_heads * case.keys * args.head_dim * dtype.itemsize * args.layers
    print(f"decode attention, {args.rows} rows at position {args.position}, {args.heads} query heads over "
          f"{args.kv_heads} KV heads of {args.head_dim}, {args.layers} layers, {args.dtype}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {kv_bytes / 1e6:.0f} MB of K/V a step")
    errors = {}
    with torch.inference_mode():
        for name, run in runs.items():
            start = time.perf_counter()
            out = run(0)  # FlexAttention compiles here
            if name != "the dense copy alone":
                errors[name] = (out.double() - case.reference(0)).abs().max().item()
            if name.startswith("FlexAttention"):
                print(f"  {name}: compiled and ran once in {time.perf_counter() - start:.1f} s")
        spent: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, run in runs.items():
                start = time.perf_counter()
                for layer in range(args.layers):
                    run(layer)
                spent[name].append(time.perf_counter() - start)
    native = statistics.median(spent["native kernel"])
    bandwidth = read_bandwidth()
    print(f"  this CPU streams {bandwidth / 1e9:.1f} GB/s (a read of 512 MB, measured now): the K/V at that speed "
          f"would take {kv_bytes / bandwidth * 1e3:.1f} ms")
    for name, times in spent.items():
        median = statistics.median(times)
        error = f", max error {errors[name]:.1e}" if name in errors else ""
        print(f"  {name:<22} median {median * 1e3:7.1f} ms (min {min(times) * 1e3:6.1f}), "
              f"{kv_bytes / median / 1e9:5.1f} GB/s of K/V, {median / native:5.2f}x the kernel{error}")


if __name__ == "__main__":
    main()
