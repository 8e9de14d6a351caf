"""Where decode attention reads each row's KV blocks: the ``BlockMajorDecode`` of a step.

Blocks read by one row are used where they lie in the pool, as a few dense ranges
(segments): a batched product over a range costs the same per block whether a row owns
the block or not, so long runs of other rows' (or free) blocks are cut out, and only
when blocks are scattered beyond that are they copied next to each other. Blocks read by
several rows (a shared prefix, n > 1 siblings) are copied once and met by every
reader's query in one product.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from workers.model.paged_attention import BlockMajorDecode

MAX_SEGMENTS = 8  # each segment is one more pair of small batched products per layer
MIN_GAP = 4  # unowned blocks worth a new segment: about what one more product call costs
MAX_WASTE = 3  # above this many covered blocks per owned block, copy the blocks instead


def choose_segments(own: np.ndarray) -> list[tuple[int, int]]:
    """Ranges ``[lo, hi)`` of pool blocks covering ``own`` (distinct block ids), cut at its widest gaps."""
    if own.size == 0:
        return []
    blocks = np.sort(own)
    gaps = blocks[1:] - blocks[:-1] - 1
    widest = np.argsort(-gaps, kind="stable")[: MAX_SEGMENTS - 1]
    cuts = sorted(int(i) for i in widest if gaps[i] >= MIN_GAP)
    starts = [0] + [i + 1 for i in cuts]
    ends = cuts + [blocks.size - 1]
    return [(int(blocks[s]), int(blocks[e]) + 1) for s, e in zip(starts, ends)]


def _cover_owned(own: np.ndarray, num_blocks: int, needs_masked: bool) -> tuple[list[tuple[int, int]],
                                                                               np.ndarray | None, int]:
    """The entries 0..span-1 of the blocks read by one row: pool segments back to back, or one compact copy
    (``gather``) where segments would waste too much. ``needs_masked``: padding needs an entry no row owns, so
    one more block is covered where every covered one is owned. Returns (segments, gather, span)."""
    segments = choose_segments(own)
    gather = None
    covered = sum(hi - lo for lo, hi in segments)
    if covered > MAX_WASTE * own.size:
        gather, segments, covered = own, [(0, own.size)], own.size
    if needs_masked and covered == own.size:
        if gather is None and segments[-1][1] < num_blocks:
            segments[-1] = (segments[-1][0], segments[-1][1] + 1)
        elif gather is None and segments[0][0] > 0:
            segments[0] = (segments[0][0] - 1, segments[0][1])
        else:  # no unowned block next to the segments: a compact copy plus a masked copy of one block
            gather = np.append(own, own[0])
            segments = [(0, gather.size)]
        covered += 1
    return segments, gather, covered


def _shared_lanes(shared: np.ndarray, used_shared: np.ndarray, rows_shared: np.ndarray, lanes: int, span: int,
                  num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks several rows read get one entry per reader (a lane) after the owned span: each such (row, block)
    pair's entry, and each shared block's lane -> row (``num_rows`` for an unused lane)."""
    shared_index = np.searchsorted(shared, used_shared)
    order = np.argsort(shared_index, kind="stable")
    sorted_index = shared_index[order]
    first = np.searchsorted(sorted_index, sorted_index)  # start of each block's run
    lane = np.empty_like(shared_index)
    lane[order] = np.arange(sorted_index.size) - first
    lane_rows = np.full((shared.size, lanes), num_rows, dtype=np.int64)
    lane_rows[shared_index, lane] = rows_shared
    return span + shared_index * lanes + lane, lane_rows


def block_major_layout(tables: Sequence[Sequence[int]], query_positions: Sequence[Sequence[int]],
                       query_offsets: Sequence[int], block_size: int, num_blocks: int,
                       device: torch.device) -> BlockMajorDecode:
    """Layout for rows of one or a few queries.

    ``tables[r]``: row r's blocks up to its last query; ``query_positions[r]``: its queries'
    absolute positions, packed from ``query_offsets[r]`` in the step's sequence.
    """
    num_rows = len(tables)
    counts = np.fromiter((len(t) for t in tables), dtype=np.int64, count=num_rows)
    used = np.fromiter((b for t in tables for b in t), dtype=np.int64, count=int(counts.sum()))
    pair_row = np.repeat(np.arange(num_rows), counts)
    pair_index = np.concatenate([np.arange(c) for c in counts])  # j: the block's place in its row
    q_len = max(len(p) for p in query_positions)
    token_index = np.zeros((num_rows, q_len), dtype=np.int64)
    query = np.full((num_rows, q_len), -1, dtype=np.int64)  # padding queries attend nothing
    for r, (offset, pos) in enumerate(zip(query_offsets, query_positions)):
        token_index[r, : len(pos)] = np.arange(offset, offset + len(pos))
        query[r, : len(pos)] = pos
    valid = (query >= 0).reshape(-1)
    distinct, inverse, users = np.unique(used, return_inverse=True, return_counts=True)
    shared_pair = users[inverse] > 1
    width = int(counts.max())

    # Blocks read by one row: entries 0..span-1, the segments back to back (or one compact copy).
    own = used[~shared_pair]
    pad_entry = None
    shared = distinct[users > 1]
    lanes = int(users.max()) + 1 if shared.size else 0  # one spare lane: a masked entry for padding
    needs_masked = not shared.size and width != int(counts.min())
    segments, gather, covered = _cover_owned(own, num_blocks, needs_masked)
    span = covered
    if gather is not None:
        local = np.arange(own.size)
    else:
        lows = np.array([lo for lo, _ in segments], dtype=np.int64)
        starts = np.cumsum([0] + [hi - lo for lo, hi in segments], dtype=np.int64)[:-1]
        segment_of = np.searchsorted(lows, own, side="right") - 1
        local = own - lows[segment_of] + starts[segment_of]
    if shared.size:
        pad_entry = span + lanes - 1
    elif covered > own.size:
        owned = np.zeros(span, dtype=bool)
        owned[local] = True
        pad_entry = int(np.flatnonzero(~owned)[0])
    entries = span + shared.size * lanes
    entry_of_pair = np.empty(used.size, dtype=np.int64)
    entry_of_pair[~shared_pair] = local
    lane_rows = None
    if shared.size:
        entry_of_pair[shared_pair], lane_rows = _shared_lanes(shared, used[shared_pair], pair_row[shared_pair],
                                                              lanes, span, num_rows)
    row_of_block = np.zeros(span, dtype=np.int64)
    row_of_block[local] = pair_row[~shared_pair]
    key_pos = np.full((entries, block_size), -1, dtype=np.int64)
    key_pos[entry_of_pair] = pair_index[:, None] * block_size + np.arange(block_size)
    query_pos = np.full((entries, q_len), -1, dtype=np.int64)
    query_pos[entry_of_pair] = query[pair_row]
    row_blocks = np.full((num_rows, width), pad_entry if pad_entry is not None else 0, dtype=np.int64)
    row_blocks[pair_row, pair_index] = entry_of_pair

    def tensor(array: np.ndarray | None) -> torch.Tensor | None:
        return None if array is None else torch.from_numpy(np.ascontiguousarray(array)).to(device)

    return BlockMajorDecode(
        segments=segments, gather=tensor(gather), pad_entry=pad_entry,
        q_len=q_len, token_index=tensor(token_index), tokens=tensor(token_index.reshape(-1)[valid]),
        valid_flat=tensor(np.flatnonzero(valid)),
        row_of_block=tensor(row_of_block), row_blocks=tensor(row_blocks),
        key_pos=tensor(key_pos), query_pos=tensor(query_pos),
        shared_blocks=tensor(shared) if shared.size else None, lane_rows=tensor(lane_rows),
    )
