"""Per-request sampling parameters, with vLLM's fields, defaults and checks.

Mutable like vLLM's: the engine completes a request's params once at
admission (``update_from_generation_config`` adds EOS to the stop ids,
``update_from_tokenizer`` tokenizes bad words); nothing changes them later.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Protocol

from processors.structured_outputs import GUIDED_ALIASES, StructuredOutputsParams

SAMPLING_EPS = 1e-5  # temperatures below this are greedy
MIN_RANDOM_TEMPERATURE = 1e-2  # smaller positive temperatures are raised to this (as vLLM)
LOGIT_BIAS_LIMIT = 100.0


def is_greedy(temperature: float) -> bool:
    """The one definition of a greedy row (as vLLM's ``SamplingType.GREEDY``): the scheduler, the sampler and
    the temperature processor all ask this."""
    return temperature < SAMPLING_EPS


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def derive_request_key(request_id: str, engine_seed: int) -> int:
    """A 63-bit key from the request id and engine seed (no Python ``hash()``: it varies per process)."""
    digest = hashlib.blake2b(f"{engine_seed}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# vLLM / OpenAI request fields this engine does not implement: a request that sets them is
# rejected, never silently run without them. A default value (the field left off) passes.
UNSUPPORTED_FIELDS = {
    "best_of": "only n completions are generated, not best_of > n candidates ranked by logprob",
    "use_beam_search": "beam search is not implemented; use n > 1 with sampling",
    "beam_width": "beam search is not implemented; use n > 1 with sampling",
    "truncate_prompt_tokens": "prompts are never truncated; a prompt that does not fit is an error",
    "logits_processors": "per-request callables do not cross processes; configure processors by class name",
    "output_kind": "outputs are cumulative with per-output deltas (new_text, new_token_ids)",
}
UNSUPPORTED_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "use_beam_search": (None, False), "beam_width": (None, 1),
    "truncate_prompt_tokens": (None,), "logits_processors": (None, []),
    "output_kind": (None,),
}


def _fail(field_name: str, message: str) -> ValueError:
    return ValueError(f"{field_name} {message}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _normalize_logit_bias(value: Any) -> dict[int, float] | None:
    """Accept int or str token keys (JSON carries strings); clamp biases to +-100."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _fail("logit_bias", f"must be a mapping of token id to bias, got {type(value).__name__}.")
    out: dict[int, float] = {}
    bad_keys = []
    for token, bias in value.items():
        try:
            token_id = int(token)
        except (TypeError, ValueError):
            bad_keys.append(token)
            continue
        if isinstance(token, float) and token != token_id:
            bad_keys.append(token)
            continue
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise _fail("logit_bias", f"values must be finite numbers, got {bias!r} for token {token!r}.")
        out[token_id] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(bias)))
    if bad_keys:
        raise _fail("logit_bias", f"contains key(s) that are not integer token ids: {bad_keys!r}.")
    return out


@dataclass
class SamplingParams:
    """Sampling parameters of one request (OpenAI completion semantics, as vLLM)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # Each prompt token's logprob and the top ``prompt_logprobs`` others at its position (-1: the whole
    # vocabulary, where model.max_logprobs allows it), as vLLM: RequestOutput.prompt_logprobs.
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    bad_words: list[str] | None = None
    thinking_token_budget: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's fields this engine does not implement (UNSUPPORTED_FIELDS): taken as vLLM's constructor takes
    # them, so that a vLLM script gets a ValueError naming what is missing instead of a bare TypeError.
    best_of: int | None = field(default=None, repr=False, compare=False)
    use_beam_search: bool | None = field(default=None, repr=False, compare=False)
    beam_width: int | None = field(default=None, repr=False, compare=False)
    truncate_prompt_tokens: int | None = field(default=None, repr=False, compare=False)
    logits_processors: Any = field(default=None, repr=False, compare=False)
    output_kind: Any = field(default=None, repr=False, compare=False)

    # Set by the engine at admission, never by users.
    _eos_token_id: int | None = field(default=None, repr=False, compare=False)
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False, compare=False)
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)
    _request_key: int | None = field(default=None, repr=False, compare=False)
    _child_index: int = field(default=0, repr=False, compare=False)
    # The request's LoRA adapter (``processors.lora_request.LoRARequest``), set by the entry points from
    # ``lora_request=`` or a line's model name: it travels with the request's params to every worker.
    _lora: Any = field(default=None, repr=False, compare=False)
    # Params made only to carry ``_lora`` for a prompt given no params: the engine fills in its defaults.
    _engine_defaults: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, why in UNSUPPORTED_FIELDS.items():
            value = getattr(self, name)
            if value not in UNSUPPORTED_DEFAULTS.get(name, (None,)) and not (name == "best_of" and value == self.n):
                raise ValueError(f"{name} is not supported: {why}.")
            setattr(self, name, None)
        self.logit_bias = _normalize_logit_bias(self.logit_bias)
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:
            self.seed = None
        if self.thinking_token_budget == -1:
            self.thinking_token_budget = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise _fail("stop", f"must be a string or a list of strings, got {type(self.stop).__name__}.")
        self.stop_token_ids = [] if self.stop_token_ids is None else list(dict.fromkeys(self.stop_token_ids))
        self.bad_words = [] if self.bad_words is None else list(dict.fromkeys(self.bad_words))
        if self.logprobs is True:
            self.logprobs = 1
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise _fail("extra_args", f"must be a mapping, got {type(self.extra_args).__name__}.")
        self._verify_args()
        if 0 < self.temperature < MIN_RANDOM_TEMPERATURE:
            self.temperature = MIN_RANDOM_TEMPERATURE
        if is_greedy(self.temperature):
            # Greedy: the filtering knobs have no effect, so turn them off (as vLLM).
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
            if self.n > 1:
                raise _fail("n", f"must be 1 when using greedy sampling, got {self.n}.")
        self._all_stop_token_ids = set(self._all_stop_token_ids) | set(self.stop_token_ids)

    def _verify_args(self) -> None:
        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise _fail(name, f"must be a number, got {type(value).__name__}.")
            if not math.isfinite(value):
                raise _fail(name, f"must be a finite number, got {value}.")
            return value

        def integer(name: str, optional: bool = False) -> int | None:
            value = getattr(self, name)
            if value is None and optional:
                return None
            if not _is_int(value):
                raise _fail(name, f"must be an integer, got {type(value).__name__}.")
            return value

        if integer("n") < 1:
            raise _fail("n", f"must be at least 1, got {self.n}.")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= number(name) <= 2.0:
                raise _fail(name, f"must be in [-2, 2], got {getattr(self, name)}.")
        if number("repetition_penalty") <= 0.0:
            raise _fail("repetition_penalty", f"must be greater than zero, got {self.repetition_penalty}.")
        if not 0.0 <= number("temperature") <= 2.0:
            raise _fail("temperature", f"must be in [0, 2], got {self.temperature}.")
        if not 0.0 < number("top_p") <= 1.0:
            raise _fail("top_p", f"must be in (0, 1], got {self.top_p}.")
        if integer("top_k") < 0:
            raise _fail("top_k", f"must be 0 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= number("min_p") <= 1.0:
            raise _fail("min_p", f"must be in [0, 1], got {self.min_p}.")
        seed = integer("seed", optional=True)
        if seed is not None and not -(2**63) <= seed < 2**64:
            raise _fail("seed", f"must be in [-2**63, 2**64) (a 64-bit seed, as torch.manual_seed takes), got {seed}.")
        max_tokens = integer("max_tokens", optional=True)
        if max_tokens is not None and max_tokens < 1:
            raise _fail("max_tokens", f"must be at least 1, got {max_tokens}.")
        if integer("min_tokens") < 0:
            raise _fail("min_tokens", f"must be greater than or equal to 0, got {self.min_tokens}.")
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise _fail("min_tokens", f"must be less than or equal to max_tokens={max_tokens}, got {self.min_tokens}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = integer(name, optional=True)
            if value is not None and value < 0 and value != -1:
                raise _fail(name, f"must be non-negative or -1, got {value}.")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise _fail("stop_token_ids", f"must contain only non-negative integers, got {self.stop_token_ids}.")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise _fail("stop", f"must contain only non-empty strings, got {self.stop}.")
        if self.stop and not self.detokenize:
            raise _fail("stop", "strings are only supported when detokenize is True.")
        if not all(isinstance(w, str) and w for w in self.bad_words):
            raise _fail("bad_words", f"must contain only non-empty strings, got {self.bad_words}.")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise _fail("allowed_token_ids", "must not be empty.")
            if not all(_is_int(t) and t >= 0 for t in self.allowed_token_ids):
                raise _fail("allowed_token_ids", f"must contain only non-negative integers, got {self.allowed_token_ids}.")
        if self.logit_bias and any(t < 0 for t in self.logit_bias):
            raise _fail("logit_bias", f"token ids must be non-negative, got {sorted(self.logit_bias)}.")
        budget = integer("thinking_token_budget", optional=True)
        if budget is not None and budget < 0:
            raise _fail("thinking_token_budget", f"must be a non-negative integer or -1 for unlimited, got {budget}.")

    # ----- engine-side completion -----

    @property
    def sampling_type(self) -> SamplingType:
        if is_greedy(self.temperature):
            return SamplingType.GREEDY
        return SamplingType.RANDOM_SEED if self.seed is not None else SamplingType.RANDOM

    @property
    def sampling_key(self) -> int:
        """Key of this row's random stream: its seed (else the key derived at admission), mixed
        with the completion index for the siblings of an ``n > 1`` request (index 0 keeps it)."""
        base = self.seed if self.seed is not None else (self._request_key if self._request_key is not None else 0)
        base = (base + 2**63) % 2**64 - 2**63  # one int64 key per 64-bit seed (2**64 - 1 and -1 agree, as in torch)
        if self._child_index == 0:
            return base
        digest = hashlib.blake2b(f"{base}:{self._child_index}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1

    def child(self, index: int) -> SamplingParams:
        """Params of completion ``index`` of an ``n > 1`` request: one row, its own random stream."""
        params = dataclasses.replace(self, n=1)
        params._child_index = index
        return params

    def assign_request_key(self, request_id: str, engine_seed: int) -> None:
        """Give an unseeded request a stream of its own, stable across processes."""
        self._request_key = derive_request_key(request_id, engine_seed)

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def all_stop_token_ids(self) -> set[int]:
        """Stop token ids plus EOS (once the engine set it); what min_tokens masks."""
        return self._all_stop_token_ids

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        return self._bad_words_token_ids

    def update_from_generation_config(
        self, generation_config: dict[str, Any], eos_token_id: int | None = None
    ) -> None:
        """Fold the model's EOS ids into the stop ids (EOS stops only without ignore_eos)."""
        if not self.ignore_eos:
            self._eos_token_id = eos_token_id
        if eos_token_id is not None:
            self._all_stop_token_ids.add(eos_token_id)
        extra = generation_config.get("eos_token_id")
        if extra is not None:
            extra_ids = {extra} if _is_int(extra) else set(extra)
            extra_ids.discard(eos_token_id)
            if extra_ids:
                self._all_stop_token_ids.update(extra_ids)
                if not self.ignore_eos:
                    self.stop_token_ids = list(dict.fromkeys([*self.stop_token_ids, *sorted(extra_ids)]))

    def update_from_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Tokenize ``bad_words``, with and without a leading space (as vLLM)."""
        if self.bad_words:
            self._bad_words_token_ids = tokenize_bad_words(self.bad_words, tokenizer)

    # ----- plain-data round trip (JSON lines carry these) -----

    def to_dict(self) -> dict[str, Any]:
        """User-settable fields that differ from the defaults, JSON-ready."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name.startswith("_") or f.name in UNSUPPORTED_FIELDS:
                continue
            value = getattr(self, f.name)
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if f.name in ("stop", "stop_token_ids", "bad_words") and value == []:
                continue
            if value != default:
                if f.name == "logit_bias":
                    value = {str(k): v for k, v in value.items()}
                elif f.name == "structured_outputs":
                    value = value.to_dict()
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from plain data; unknown keys are an error naming them."""
        if not isinstance(data, dict):
            raise ValueError(f"sampling_params must be a mapping, got {type(data).__name__}.")
        known = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_") and f.name not in UNSUPPORTED_FIELDS}
        aliases = {k: v for k, v in data.items() if k in GUIDED_ALIASES}
        if aliases:
            if "structured_outputs" in data:
                raise ValueError(f"give structured_outputs or {sorted(aliases)}, not both.")
            data = {k: v for k, v in data.items() if k not in GUIDED_ALIASES}
            data["structured_outputs"] = {GUIDED_ALIASES[k]: v for k, v in aliases.items()}
        if "best_of" in data and data["best_of"] == data.get("n", 1):
            data = {k: v for k, v in data.items() if k != "best_of"}  # best_of == n ranks nothing
        for name, why in UNSUPPORTED_FIELDS.items():
            if name in data and data[name] not in UNSUPPORTED_DEFAULTS.get(name, (None,)):
                raise ValueError(f"sampling_params.{name} is not supported: {why}.")
        data = {k: v for k, v in data.items() if k not in UNSUPPORTED_FIELDS}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"sampling_params has unknown field(s) {unknown}; known fields: {sorted(known)}.")
        return cls(**data)

    def clone(self) -> SamplingParams:
        return dataclasses.replace(self)


def tokenize_bad_words(bad_words: Sequence[str], tokenizer: Tokenizer) -> list[list[int]]:
    """Each word as token ids, alone and after a space (as vLLM), so it is banned
    both at the start of the text and mid-sentence."""
    sequences: list[list[int]] = []
    for word in bad_words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            raise ValueError(f"bad_words entry {word!r} tokenizes to no token.")
        sequences.append(list(bare))
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        # Only a distinct word-start form of the same length is a second spelling.
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(list(spaced))
    return sequences
