"""The order in which a batch's requests enter the engine: requests that share a prompt prefix side by side.

A batch file read question by question (every document's first question, then every document's
second, ...) evicts each document from the prefix cache before its next question arrives; admitted
side by side, a document's questions share its blocks. The order is a depth-first walk of the
prefix tree of the window's prompts, children in the order the input first reaches them: requests
that share nothing keep their input order, and a group is placed where its first request was.

The tree is over fixed-size chunks of the prompt (token ids, or the UTF-8 bytes of a text prompt
the engine tokenizes itself: a shared text prefix tokenizes to a shared token prefix but for the
last few tokens), so it costs one small hash per chunk. The order decides only when a request
is admitted, never what it generates: sampling is keyed by seed and position.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Any

ID_CHUNK = 16  # token ids per node of the tree: the engine's default KV block
TEXT_CHUNK = 64  # bytes of text per node: about 16 tokens of English


def chunk_keys(prompt: Any, max_chunks: int | None = None) -> list[bytes]:
    """Keys of the prompt's full chunks, each chaining the ones before it (a node of the prefix tree).

    ``prompt``: text, a list of token ids, or anything else (one node of its own: it groups with nothing)."""
    if isinstance(prompt, str):
        data, size, parent = prompt.encode("utf-8", "surrogatepass"), TEXT_CHUNK, b"text"
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        data, size, parent = array("q", prompt).tobytes(), ID_CHUNK * 8, b"ids"
    else:
        return []
    count = len(data) // size if max_chunks is None else min(max_chunks, len(data) // size)
    keys = []
    for start in range(0, count * size, size):
        parent = hashlib.blake2b(data[start : start + size], digest_size=8, key=parent[:8]).digest()
        keys.append(parent)
    return keys


def prefix_order(prompts: Sequence[Any]) -> list[int]:
    """Indices of ``prompts`` in admission order: each shared prefix's requests together, groups where
    their first request stands, and the input order wherever nothing is shared."""
    first_seen: dict[bytes, int] = {}
    paths = []
    for index, prompt in enumerate(prompts):
        path = [first_seen.setdefault(key, index) for key in chunk_keys(prompt)]
        path.append(index)
        paths.append(path)
    return sorted(range(len(prompts)), key=paths.__getitem__)


def requests_by_prefix(requests: Sequence[Any]) -> list[int]:
    """``prefix_order`` of requests (anything with ``prompt_token_ids``), as the scheduler's held queue asks."""
    return prefix_order([r.prompt_token_ids for r in requests])
