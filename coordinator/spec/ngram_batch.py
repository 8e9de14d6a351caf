"""N-gram drafts for every decoding row at once, with array operations.

``NgramDrafter.propose`` searches a row's whole history for the latest earlier occurrence
of its last n tokens; run per row, per step, in Python, that is the cost of speculative
decoding on the coordinator's critical path (about 5 us a row). Here every row's tokens sit
in one array, and an open-addressing hash map in numpy arrays keeps, for each (row, n-gram),
the end of its latest occurrence that ends before the row's last token: a step indexes only
the tokens accepted since the last one and looks every row's tails up in a few vectorized
probes. A hit is checked against the tokens themselves; a hash collision (two n-grams, one
64-bit key) falls back to the search for that row, so the drafts are always the search's.
"""

from __future__ import annotations

import numpy as np

from coordinator.spec.ngram_drafter import NgramDrafter

_MIX = np.uint64(0x9E3779B97F4A7C15)
_STEP = np.uint64(0xBF58476D1CE4E5B9)
_EMPTY = -1


def ngram_keys(windows: np.ndarray) -> np.ndarray:
    """64-bit keys of n-grams given as rows of ``windows`` (last token first), per length 1..n:
    returns (len(windows), n) where column j is the key of the (j + 1)-gram."""
    count, width = windows.shape
    keys = np.empty((count, width), dtype=np.uint64)
    h = np.zeros(count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(width):
            h = (h ^ windows[:, j].astype(np.uint64)) * _MIX + _STEP * np.uint64(j + 1)
            keys[:, j] = h
    return keys.view(np.int64)


class NgramMap:
    """(uid, key) -> int, open addressing with linear probing; -1 marks an empty cell."""

    def __init__(self, capacity: int = 1 << 12) -> None:
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self.mask = np.uint64(capacity - 1)
        self.uid = np.full(capacity, _EMPTY, dtype=np.int64)
        self.key = np.zeros(capacity, dtype=np.int64)
        self.value = np.zeros(capacity, dtype=np.int32)
        self._claim = np.zeros(capacity, dtype=np.int64)  # scratch: who claims an empty cell
        self.count = 0

    def _home(self, uids: np.ndarray, keys: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            h = (uids.astype(np.uint64) * _STEP) ^ keys.view(np.uint64)
            h = (h ^ (h >> np.uint64(29))) * _MIX
        return ((h >> np.uint64(17)) & self.mask).astype(np.int64)

    def put(self, uids: np.ndarray, keys: np.ndarray, values: np.ndarray) -> None:
        """Set each (uid, key) to its value. The pairs of one call must be distinct (callers put
        a row's occurrences in rounds, oldest first, so the latest one wins)."""
        if len(uids) == 0:
            return
        if (self.count + len(uids)) * 2 > self.capacity:
            self._grow(len(uids))
        pos = self._home(uids, keys)
        pending = np.arange(len(uids))
        mask = int(self.mask)
        while pending.size:
            p = pos[pending]
            cu = self.uid[p]
            same = (cu == uids[pending]) & (self.key[p] == keys[pending])
            self.value[p[same]] = values[pending[same]]
            empty = np.flatnonzero(cu == _EMPTY)
            done = same
            if empty.size:  # several may want one empty cell: one claim sticks, the others probe on
                cells, claimants = p[empty], pending[empty]
                self._claim[cells] = claimants
                won = self._claim[cells] == claimants
                cells, winners = cells[won], claimants[won]
                self.uid[cells] = uids[winners]
                self.key[cells] = keys[winners]
                self.value[cells] = values[winners]
                self.count += len(winners)
                done[empty[won]] = True
                cu[empty] = 0  # a lost claim: the cell now holds another pair, so probe on from it
            moved = ~done & (cu != _EMPTY)
            pos[pending[moved]] = (p[moved] + 1) & mask
            pending = pending[~done]

    def get(self, uids: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Each pair's value, or -1."""
        out = np.full(len(uids), -1, dtype=np.int64)
        pos = self._home(uids, keys)
        pending = np.arange(len(uids))
        while pending.size:
            p = pos[pending]
            cu = self.uid[p]
            hit = (cu == uids[pending]) & (self.key[p] == keys[pending])
            out[pending[hit]] = self.value[p[hit]]
            go_on = ~hit & (cu != _EMPTY)
            pending = pending[go_on]
            pos[pending] = (pos[pending] + 1) & int(self.mask)
        return out

    def _grow(self, incoming: int) -> None:
        """Re-home the pairs still in use (``alive``) into a table at most half full after ``incoming`` more."""
        live = self.uid != _EMPTY
        if self.alive is not None:
            live &= np.isin(self.uid, self.alive())
        uids, keys, values = self.uid[live], self.key[live], self.value[live]
        capacity = self.capacity
        while capacity < 2 * (len(uids) + incoming):
            capacity *= 2
        self._alloc(capacity)
        self.put(uids, keys, values)

    alive = None  # optional: () -> uids still in use, so growing drops the others


class BatchNgramDrafter:
    """Token histories of the rows (by slot) and the n-gram map over them."""

    def __init__(self, drafter: NgramDrafter, slots: int, width: int = 256) -> None:
        self.drafter = drafter
        self.k, self.min_n, self.max_n = drafter.k, drafter.min_n, drafter.max_n
        self.history = np.zeros((slots, width), dtype=np.int32)
        self.length = np.zeros(slots, dtype=np.int64)  # tokens held
        self.indexed = np.zeros(slots, dtype=np.int64)  # occurrences ending before this are in the map
        self.uid = np.full(slots, -1, dtype=np.int64)
        self._next_uid = 0
        self.map = NgramMap()
        self.map.alive = lambda: self.uid[self.uid >= 0]

    def _fit(self, length: int) -> None:
        width = self.history.shape[1]
        if length > width:
            grown = np.zeros((self.history.shape[0], max(2 * width, length)), dtype=np.int32)
            grown[:, :width] = self.history
            self.history = grown

    def admit(self, slot: int, tokens: list[int]) -> None:
        """A row enters (or re-enters) with these tokens (prompt + output so far)."""
        self._fit(len(tokens))
        self.history[slot, : len(tokens)] = tokens
        self.length[slot] = len(tokens)
        self.indexed[slot] = 0
        self.uid[slot] = self._next_uid
        self._next_uid += 1

    def release(self, slot: int) -> None:
        self.uid[slot] = -1

    def append(self, slots: np.ndarray, counts: np.ndarray, tokens: np.ndarray) -> None:
        """Rows ``slots`` accepted ``counts`` tokens each, ``tokens`` flat in the same order."""
        keep = counts > 0
        slots, counts = slots[keep], counts[keep]
        if slots.size == 0:
            return
        start = self.length[slots]
        self._fit(int((start + counts).max()))
        row_ix = np.repeat(np.arange(len(slots)), counts)
        within = np.arange(len(row_ix)) - np.repeat(np.cumsum(counts) - counts, counts)
        self.history[slots[row_ix], start[row_ix] + within] = tokens
        self.length[slots] = start + counts

    def _index(self, slots: np.ndarray) -> None:
        """Put in the map the occurrences ending at ``indexed .. length - 1`` of these rows."""
        first = np.maximum(self.indexed[slots], self.min_n)
        last = self.length[slots] - 1  # an occurrence must end before the last token
        counts = np.maximum(last - first + 1, 0)
        self.indexed[slots] = np.maximum(self.indexed[slots], last + 1)
        if counts.sum() == 0:
            return
        row_ix = np.repeat(np.arange(len(slots)), counts)
        ends = np.repeat(first, counts) + (np.arange(len(row_ix)) - np.repeat(np.cumsum(counts) - counts, counts))
        rows = slots[row_ix]
        keys = ngram_keys(self._windows(rows, ends))
        uids = self.uid[rows]
        rank = np.arange(len(row_ix)) - np.repeat(np.cumsum(counts) - counts, counts)
        for r in range(int(counts.max())):  # one occurrence per row per round, oldest first
            at = np.flatnonzero(rank == r)
            parts = [(at[ends[at] >= n], n) for n in range(self.min_n, self.max_n + 1)]
            self.map.put(np.concatenate([uids[i] for i, _ in parts]),
                         np.concatenate([keys[i, n - 1] for i, n in parts]),
                         np.concatenate([ends[i] for i, _ in parts]).astype(np.int32))

    def _windows(self, rows: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Tokens ``end - 1, end - 2, ... end - max_n`` of each (row, end); 0 before the start."""
        back = np.arange(1, self.max_n + 1)
        at = ends[:, None] - back[None, :]
        windows = self.history[rows[:, None], np.maximum(at, 0)]
        windows[at < 0] = 0
        return windows

    def propose(self, slots: np.ndarray, rooms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Drafts for rows ``slots`` (at most ``rooms`` each): (count per row, drafts flat in row order),
        exactly ``NgramDrafter.propose(tokens, room)`` for each."""
        self._index(slots)
        total = self.length[slots]
        k = np.minimum(self.k, rooms)
        want = (k > 0) & (total >= self.min_n + 1)
        ends = np.full(len(slots), -1, dtype=np.int64)
        found_n = np.zeros(len(slots), dtype=np.int64)
        rows = np.flatnonzero(want)
        if rows.size:
            s = slots[rows]
            tails = self._windows(s, total[rows])
            keys = ngram_keys(tails)
            uids = self.uid[s]
            open_ = np.ones(len(rows), dtype=bool)
            for n in range(self.max_n, self.min_n - 1, -1):
                ask = open_ & (total[rows] - 1 >= n)
                if not ask.any():
                    continue
                got = self.map.get(uids[ask], keys[ask, n - 1])
                idx = np.flatnonzero(ask)[got >= 0]
                ends[rows[idx]] = got[got >= 0]
                found_n[rows[idx]] = n
                open_[idx] = False
            self._check(slots, ends, found_n, total)
        counts = np.where(ends >= 0, np.minimum(k, total - ends), 0).clip(min=0)
        row_ix = np.repeat(np.arange(len(slots)), counts)
        within = np.arange(len(row_ix)) - np.repeat(np.cumsum(counts) - counts, counts)
        flat = self.history[slots[row_ix], ends[row_ix] + within]
        return counts.astype(np.int32), flat

    def _check(self, slots: np.ndarray, ends: np.ndarray, found_n: np.ndarray, total: np.ndarray) -> None:
        """Verify every hit against the tokens; a collision is answered by the search itself."""
        hit = np.flatnonzero(ends >= 0)
        if hit.size == 0:
            return
        s, n, e, t = slots[hit], found_n[hit], ends[hit], total[hit]
        back = np.arange(1, self.max_n + 1)[None, :]
        valid = back <= n[:, None]
        a = self.history[s[:, None], np.maximum(e[:, None] - back, 0)]
        b = self.history[s[:, None], np.maximum(t[:, None] - back, 0)]
        bad = np.flatnonzero(((a != b) & valid).any(axis=1))
        for i in bad.tolist():  # a 64-bit collision: the search answers for this row
            row = hit[i]
            ends[row] = _search_end(self.history[slots[row], : total[row]].tolist(), self.min_n, self.max_n)


def _search_end(tokens: list[int], min_n: int, max_n: int) -> int:
    """Where the search's match ends (the drafts start), or -1."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        tail = tokens[total - n :]
        for end in range(total - 1, n - 1, -1):
            if tokens[end - n : end] == tail:
                return end
    return -1
