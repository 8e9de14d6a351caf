"""KV block accounting, kept on the coordinator for every worker's pool.

The coordinator decides which blocks every request uses and sends block ids in
the plan, so admission, prefix-cache hits and preemption are a deterministic
function of the plan history: no worker has private state that scheduling
depends on. Per worker: a free queue (least recently freed evicted first), ref
counts, and a prefix index from block-content keys to blocks. A key chains
the previous block's key with the block's tokens (blake2b, 128 bits) and
starts from a salt, so ``n > 1`` siblings share their prompt blocks even when
prefix caching across requests is off.
"""

from __future__ import annotations

import hashlib
import heapq
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

_BIG_ENDIAN = sys.byteorder == "big"
assert array("I").itemsize == 4, "prefix keys hash token ids as 4-byte words"


def chain_keys(tokens: Sequence[int], block_size: int, salt: bytes, start: Sequence[bytes] = (),
               num_blocks: int | None = None) -> list[bytes]:
    """Keys of the full blocks of ``tokens`` (the first ``num_blocks``); ``start`` are keys already
    computed for the first blocks."""
    keys = list(start)
    extend_keys(keys, tokens, block_size, salt, len(tokens) // block_size if num_blocks is None else num_blocks)
    return keys


def extend_keys(keys: list[bytes], tokens: Sequence[int], block_size: int, salt: bytes, num_blocks: int,
                first_block: int = 0) -> None:
    """Append the keys of blocks ``len(keys) .. num_blocks - 1`` to ``keys``; ``tokens`` starts
    at block ``first_block``."""
    parent = keys[-1] if keys else salt
    offset = first_block * block_size
    for b in range(len(keys), num_blocks):
        start = b * block_size - offset
        words = array("I", tokens[start : start + block_size])  # 4-byte ids, little-endian
        if _BIG_ENDIAN:
            words.byteswap()
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(words.tobytes())
        parent = digest.digest()
        keys.append(parent)


class BlockPool:
    """One worker's blocks.

    Free blocks with no cached content are handed out first, lowest id first: nothing is lost
    by reusing them, and a step's blocks then stay close together in the pool, which is what
    decode attention reads in place (``workers.model.decode_layout``). Blocks holding a cached
    prefix are evicted after them, least recently used first.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.key_of: list[bytes | None] = [None] * num_blocks
        self.index: dict[bytes, int] = {}
        self.blank: list[int] = list(range(num_blocks))  # a min-heap of free blocks without a key
        self.cached: OrderedDict[int, None] = OrderedDict()  # free blocks with a key, in eviction order

    @property
    def num_free(self) -> int:
        return len(self.blank) + len(self.cached)

    def allocate(self, count: int) -> list[int]:
        """``count`` free blocks: blank ones first, then the least recently used cached ones (dropping their content)."""
        if count > self.num_free:
            raise RuntimeError(f"asked for {count} KV blocks, {self.num_free} free")
        blocks = []
        for _ in range(count):
            if self.blank:
                block = heapq.heappop(self.blank)
            else:
                block, _ = self.cached.popitem(last=False)
                key = self.key_of[block]
                if self.index.get(key) == block:
                    del self.index[key]
                self.key_of[block] = None
            self.ref[block] = 1
            blocks.append(block)
        return blocks

    def count_hits(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` this pool holds (computed, or being computed this step)."""
        count = 0
        for key in keys:
            if key not in self.index:
                break
            count += 1
        return count

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Cached blocks of the longest prefix of ``keys``."""
        hits = []
        for key in keys:
            block = self.index.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def share(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for block in blocks:
            if self.ref[block] == 0:
                del self.cached[block]  # a hit is a keyed block
            self.ref[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop references; a request's tail blocks go first in the eviction order."""
        for block in reversed(blocks):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                if self.key_of[block] is None:
                    heapq.heappush(self.blank, block)
                else:
                    self.cached[block] = None

    def register(self, block: int, key: bytes) -> None:
        if key not in self.index and self.key_of[block] is None:
            self.index[key] = block
            self.key_of[block] = key


@dataclass
class KVState:
    """A request's KV on its owner: block table, tokens computed, keys of its full blocks."""

    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    keys: list[bytes] = field(default_factory=list)
    num_registered: int = 0


class KVCacheManager:
    def __init__(self, num_workers: int, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.pools = [BlockPool(num_blocks) for _ in range(num_workers)]
        self.prefill_tokens = 0  # tokens computed for prompts (and recomputed outputs), a metric
        self.hit_tokens = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def start(self, owner: int, tokens: Sequence[int], salt: bytes | None, keys: list[bytes] | None = None) -> KVState:
        """A fresh state on ``owner``, starting from the longest cached prefix (at least one token left to run).
        ``keys``: the tokens' ``chain_keys``, when the caller has them already."""
        state = KVState()
        if salt is None:
            return state
        keys = chain_keys(tokens, self.block_size, salt) if keys is None else keys
        usable = (len(tokens) - 1) // self.block_size
        hits = self.pools[owner].lookup(keys[:usable])
        self.pools[owner].share(hits)
        state.block_table = hits
        state.num_computed = len(hits) * self.block_size
        state.keys = keys
        state.num_registered = len(hits)
        self.hit_tokens += state.num_computed
        return state

    def cached_tokens(self, owner: int, tokens: Sequence[int], salt: bytes | None, coming: set[bytes]) -> int:
        """The prompt tokens ``start`` would find computed on ``owner``, taking nothing, where the blocks keyed
        in ``coming`` will be published first (by requests admitted earlier in the same step); adds this
        prompt's full blocks to ``coming``."""
        if salt is None:
            return 0
        keys = chain_keys(tokens, self.block_size, salt)
        index = self.pools[owner].index
        usable = (len(tokens) - 1) // self.block_size
        hits = next((b for b, key in enumerate(keys[:usable]) if key not in index and key not in coming), usable)
        coming.update(keys)
        return hits * self.block_size

    def extra_blocks(self, state: KVState, num_tokens_total: int) -> int:
        return max(0, self.blocks_for(num_tokens_total) - len(state.block_table))

    def grow(self, owner: int, state: KVState, num_tokens_total: int) -> list[int]:
        """Allocate blocks so the table covers ``num_tokens_total`` positions; returns the new ones."""
        new = self.pools[owner].allocate(self.extra_blocks(state, num_tokens_total))
        state.block_table.extend(new)
        return new

    def commit(self, owner: int, state: KVState, tokens: Sequence[int], computed: int, salt: bytes | None) -> None:
        """Publish full blocks whose first ``computed`` tokens are (being) computed in this step."""
        if salt is None:
            return
        full = min(computed, len(tokens)) // self.block_size
        if full <= state.num_registered:
            return
        if len(state.keys) < full:  # keys are a function of the tokens: ones computed earlier still hold
            extend_keys(state.keys, tokens, self.block_size, salt, full)
        pool = self.pools[owner]
        for b in range(state.num_registered, full):
            pool.register(state.block_table[b], state.keys[b])
        state.num_registered = full

    def free(self, owner: int, state: KVState) -> None:
        self.pools[owner].release(state.block_table)
        state.block_table = []

    def usage(self) -> float:
        used = sum(p.num_blocks - p.num_free for p in self.pools)
        return used / max(1, sum(p.num_blocks for p in self.pools))

    def summary(self, max_model_len: int, max_num_seqs: int, note: str | None) -> str:
        """One line on the cache and the concurrency it allows (logged at start-up); ``note``: where its budget came from."""
        blocks, size, workers = self.pools[0].num_blocks, self.block_size, len(self.pools)
        per_seq = self.blocks_for(max_model_len)
        budget = f"; budget {note}" if note else ""
        return (f"KV cache: {blocks} blocks of {size} tokens on each of {workers} worker(s) = "
                f"{blocks * size * workers} tokens; {blocks // per_seq * workers} sequences of "
                f"max_model_len={max_model_len} at once, more when shorter "
                f"(max_num_seqs={max_num_seqs}); prefix caching {'on' if self.prefix_caching else 'off'}{budget}")
