"""Structured outputs as a logits processor: xgrammar matchers per row, on the BatchUpdate stream.

Every replica keeps, per row of a constrained request, an xgrammar
``GrammarMatcher`` advanced with the row's live output list: each
``update_state`` accepts the tokens the list gained and rolls back the ones it
lost, so draft tokens appended during verification are followed and undone
exactly (hence ``supports_spec_decode``). A draft the grammar rejects stops
the matcher there; that draft is masked, so verification rejects it and the
row stops at that position. ``apply_rows`` fills a packed bitmask for the
shard's constrained rows and applies it with xgrammar's kernel. With a
reasoning section, the constraint starts after the thinking end sequence, as
vLLM's reasoning-aware structured output does.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from processors.digest import digest_of
from processors.interface import BatchUpdate, LogitsProcessor
from processors.markers import Marker
from processors.sampling_params import SamplingParams
from processors.state import process_dict_updates
from processors.structured_outputs import StructuredOutputsParams

DEFAULT_CACHE_SIZE = 256


@lru_cache(maxsize=8)
def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


_XGRAMMAR_PREFIX = re.compile(r"\[\d{2}:\d{2}:\d{2}\] \S+?\.(?:cc|cpp|h):\d+: (?:Check failed: .*? is false: )?")


def grammar_error_reason(exc: Exception) -> str:
    """xgrammar's message without its timestamp, C++ source path and check text: the reason alone."""
    text = _XGRAMMAR_PREFIX.sub("", str(exc)).strip()
    return text or type(exc).__name__


class GrammarCache:
    """Compiles each distinct constraint once; least recently used evicted past ``capacity``."""

    def __init__(self, tokenizer: Any, vocab_size: int, capacity: int = DEFAULT_CACHE_SIZE, info: Any = None) -> None:
        """``info``: an ``xgrammar.TokenizerInfo`` already built (then ``tokenizer`` is not read)."""
        import xgrammar as xgr

        self.info = info if info is not None else xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self.capacity = capacity
        self._compiled: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()  # the coordinator compiles on a background thread

    def cached(self, params: StructuredOutputsParams) -> bool:
        with self._lock:
            return params.key() in self._compiled

    def get(self, params: StructuredOutputsParams) -> Any:
        key = params.key()
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        compiled = self._compile(params)
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return compiled

    def compile(self, p: StructuredOutputsParams) -> Any:
        """Compile ``p`` without caching it; ValueError with the reason when it does not compile."""
        return self._compile(p)

    def _compile(self, p: StructuredOutputsParams) -> Any:
        kind = p.kind
        try:
            if kind == "json":
                schema = p.json if isinstance(p.json, str) else json.dumps(p.json)
                return self.compiler.compile_json_schema(schema, any_whitespace=not p.disable_any_whitespace)
            if kind == "json_object":  # OpenAI's JSON mode: a JSON object, not any JSON value
                return self.compiler.compile_json_schema('{"type": "object"}',
                                                         any_whitespace=not p.disable_any_whitespace)
            if kind == "regex":
                return self.compiler.compile_regex(p.regex)
            if kind == "choice":
                alternatives = " | ".join(json.dumps(c) for c in p.choice)  # JSON escapes are EBNF escapes
                return self.compiler.compile_grammar(f"root ::= {alternatives}")
            if kind == "grammar":
                return self.compiler.compile_grammar(p.grammar)
            return self._structural_tag(p.structural_tag)
        except Exception as exc:
            raise ValueError(f"structured_outputs.{kind} could not be compiled: {grammar_error_reason(exc)}") from None


    def _structural_tag(self, text: str) -> Any:
        """vLLM's format ({"structures": [{begin, schema, end}], "triggers": [...]}) or xgrammar's own."""
        import xgrammar as xgr

        tag = json.loads(text)
        if isinstance(tag, dict) and "structures" in tag:
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                     for s in tag["structures"]]
            return self.compiler.compile_structural_tag(items, tag.get("triggers", []))
        return self.compiler.compile_structural_tag(text)


@dataclass
class RowMatcher:
    key: tuple
    matcher: Any
    prompt: list[int]
    output: list[int]  # live
    consumed: int = 0  # output tokens (after the constraint's start) the matcher has accepted
    rejected_at: int | None = None  # a token the grammar refused (a draft, rejected by verification)
    start: int | None = None  # where the constraint starts in the output; None while thinking
    scan: int = 0  # output scanned for the thinking end sequence


class StructuredOutputLogitsProcessor(LogitsProcessor):
    supports_spec_decode = True  # follows the live lists with accept / rollback

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool,
                 reasoning: tuple[Marker, Marker] | None = None, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        model = getattr(vllm_config, "model_config", None)
        self.tokenizer_path = getattr(model, "tokenizer", None)
        self.vocab_size = getattr(model, "vocab_size", 0)
        self.max_rows = vllm_config.scheduler_config.max_num_seqs
        self.device = torch.device(device)
        self.reasoning = reasoning
        self.cache_size = cache_size
        self._grammars: GrammarCache | None = None
        self._bitmask: torch.Tensor | None = None  # on the host (pinned on CUDA), filled by the matchers
        self._device_bitmask: torch.Tensor | None = None  # its copy on a GPU
        self._copied: Any = None  # the event after that copy: the host buffer is refilled only once it is done
        self._filled: list[int] | None = None  # the rows whose masks the buffers hold; None: stale
        self.rows: dict[int, RowMatcher] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def grammars(self) -> GrammarCache:
        if self._grammars is None:
            if self.tokenizer_path is None:
                raise ValueError("structured outputs need the model's tokenizer (model_config.tokenizer)")
            self._grammars = GrammarCache(load_tokenizer(self.tokenizer_path), self.vocab_size, self.cache_size)
        return self._grammars

    def _new_row(self, params: SamplingParams, prompt: list[int] | None, output: list[int]) -> RowMatcher | None:
        constraint = params.structured_outputs
        if constraint is None:
            return None
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.grammars().get(constraint), max_rollback_tokens=-1)
        row = RowMatcher(constraint.key(), matcher, list(prompt or []), output)
        row.start = None if self._thinking_open(row.prompt) else 0
        return row

    def _thinking_open(self, prompt: list[int]) -> bool:
        """The prompt opened a thinking section it did not close."""
        if self.reasoning is None:
            return False
        start, end = self.reasoning
        last_start = start.last_end(prompt, 0, len(prompt))
        return last_start >= 0 and end.first_end(prompt, last_start) < 0

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, self._new_row)
        for row in self.rows.values():
            self._sync(row)
        self._filled = None
        if self.rows:
            self._fill()  # here, while the step's forward runs, not after it

    def _masked_rows(self) -> list[int]:
        return sorted(i for i, row in self.rows.items()
                      if row.start is not None and row.rejected_at is None and not row.matcher.is_terminated())

    def _fill(self) -> None:
        """Every constrained row's mask of allowed tokens, filled on the host by its matcher, and on a GPU
        copied to the device with one non-blocking copy from pinned memory (no host wait)."""
        import xgrammar as xgr

        rows = self._masked_rows()
        if rows and self._bitmask is None:
            width = self.vocab_size or 0
            self._bitmask = xgr.allocate_token_bitmask(self.max_rows, width)
            if self.device.type == "cuda":
                self._bitmask = self._bitmask.pin_memory()
                self._device_bitmask = torch.empty_like(self._bitmask, device=self.device)
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy out of the buffer: long done
        for i in rows:
            self.rows[i].matcher.fill_next_token_bitmask(self._bitmask, i)
        if rows and self._device_bitmask is not None:
            self._device_bitmask.copy_(self._bitmask, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        self._filled = rows

    def _sync(self, row: RowMatcher) -> None:
        output = row.output
        if row.start is None or row.start > len(output):  # thinking (again, after a rollback)
            row.start = None
            if row.consumed:
                row.matcher.rollback(row.consumed)
                row.consumed, row.rejected_at = 0, None
            end = self.reasoning[1].first_end(output, row.scan)
            row.scan = len(output)
            if end < 0:
                return
            row.start = end
        target = len(output) - row.start
        if row.rejected_at is not None and row.rejected_at >= target:
            row.rejected_at = None  # the refused token is gone again
        if row.consumed > target:
            row.matcher.rollback(row.consumed - target)
            row.consumed = target
        while row.consumed < target and row.rejected_at is None:
            if row.matcher.accept_token(output[row.start + row.consumed]):
                row.consumed += 1
            else:
                row.rejected_at = row.consumed

    def apply_rows(self, logits: torch.Tensor, rows: slice) -> torch.Tensor:
        import xgrammar as xgr

        if self._filled is None or (self._bitmask is not None and self._bitmask.shape[1] * 32 < logits.shape[1]):
            if self._bitmask is not None and self._bitmask.shape[1] * 32 < logits.shape[1]:
                self._bitmask = self._device_bitmask = None  # a vocabulary wider than the config said
            self.vocab_size = max(self.vocab_size or 0, logits.shape[1])
            self._fill()
        local = [i - rows.start for i in self._filled if rows.start <= i < rows.stop]
        if not local:
            return logits
        mask = self._device_bitmask if self._device_bitmask is not None and logits.is_cuda else self._bitmask
        mask = mask[rows.start: rows.start + logits.shape[0]]
        xgr.apply_token_bitmask_inplace(logits, mask if mask.device == logits.device else mask.to(logits.device),
                                        indices=local)
        return logits

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return self.apply_rows(logits, slice(0, logits.shape[0]))

    def state_digest(self) -> bytes:
        return digest_of(sorted((i, r.key, r.consumed, r.rejected_at, r.start) for i, r in self.rows.items()))
