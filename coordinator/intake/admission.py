"""Admission: what a request must pass before it may wait for a row.

Prompts are tokenized (a text too long to fit is refused unread), parameters are
completed for this model (generation config, EOS, bad words) and checked (vocabulary,
max_model_len, logprobs, custom processors' ``validate_params``); a structured-output
constraint compiles off the step loop and the request waits until it has. A request that
fails any of it finishes alone, with the reason as its error.
"""

from __future__ import annotations

from typing import Any

from coordinator.coordinator_config import CoordinatorConfig, ModelInfo
from coordinator.intake.grammar_check import GrammarCheck
from coordinator.intake.prompt_limits import check_prompt_chars, max_prompt_chars
from coordinator.request import Request, RequestStatus
from processors import SamplingParams, validate_logits_processors_parameters
from processors.lora_request import LoRARequest
from processors.builtins.request_level import RequestLevelAdapter, check_request_setting
from workers.model.lora_files import AdapterError, read_adapter
from workers.sample.sampler import Sampler


class Admission:
    def __init__(self, tokenizer: Any, model: ModelInfo, config: CoordinatorConfig) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.config = config
        self._max_prompt_chars: int | None = None  # coordinator.intake.prompt_limits, on the first text prompt
        self._grammar_check: GrammarCheck | None = None
        self._compiling: list[Request] = []  # waiting requests whose constraint is compiling
        self._adapters: dict[Any, str] = {}  # LoRARequest -> why it cannot run ("" where it can), checked once
        self._paths: dict[int, str] = {}  # lora_int_id -> the adapter directory it names in this engine

    def tokenize(self, text: str) -> list[int]:
        """Token ids of a text prompt; ValueError, before any work, for one that cannot fit."""
        if self._max_prompt_chars is None:
            self._max_prompt_chars = max_prompt_chars(self.tokenizer, self.model.max_model_len)
        check_prompt_chars(text, self._max_prompt_chars, self.model.max_model_len)
        return list(self.tokenizer(text)["input_ids"])

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenize(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt must be a string or a list of integer token ids")
        return list(prompt)

    def _lora_problem(self, lora: Any) -> str | None:
        """Why this request's adapter cannot run (read from its files, no weights loaded), or None."""
        if not isinstance(lora, LoRARequest):
            return f"lora_request must be a LoRARequest, got {type(lora).__name__}"
        if not self.config.lora_enabled:
            return ("LoRA adapters need lora.enabled in the engine config (LLM(..., enable_lora=True), or "
                    "--lora-modules)")
        bound = self._paths.setdefault(lora.lora_int_id, lora.lora_path)
        if bound != lora.lora_path:  # the id is the adapter's identity: its weights and cached blocks
            return (f"lora_int_id {lora.lora_int_id} already names the adapter at {bound}; give the adapter at "
                    f"{lora.lora_path} an id of its own")
        checked = self._adapters.get(lora)
        if checked is None:
            try:
                read_adapter(lora.lora_path, self.model.hf_config, self.config.max_lora_rank)
                checked = ""
            except AdapterError as exc:
                checked = str(exc)
            self._adapters[lora] = checked
        return checked or None

    def error(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> str | None:
        """Complete the params for this model and check everything; return the problem, if any."""
        vocab, limit = self.model.vocab_size, self.model.max_model_len
        if not prompt_ids:
            return "prompt is empty"
        bad = sorted({t for t in prompt_ids if not 0 <= t < vocab})
        if bad:
            return f"prompt has token id(s) {bad[:8]} outside the vocabulary [0, {vocab})"
        if len(prompt_ids) >= limit:  # vLLM's words: a prompt needs room for at least one token after it
            return (f"The decoder prompt (length {len(prompt_ids)}) plus the number of requested output tokens "
                    f"(at least 1) is longer than the maximum model length of {limit}. Make sure that "
                    "`max_model_len` (model.max_model_len) is no smaller than the number of text tokens.")
        config = self.config
        cap = vocab if config.max_logprobs == -1 else min(config.max_logprobs, vocab)
        if params.logprobs == -1:  # vLLM: the whole vocabulary
            params.logprobs = vocab
        if params.logprobs is not None and params.logprobs > cap:
            return (f"Requested sample logprobs of {params.logprobs}, which is greater than max allowed: {cap} "
                    "(model.max_logprobs, at most the vocabulary; logprobs=-1 asks for all of it)")
        if params.prompt_logprobs == -1:
            params.prompt_logprobs = vocab
        if params.prompt_logprobs is not None and params.prompt_logprobs > cap:
            return (f"Requested prompt logprobs of {params.prompt_logprobs}, which is greater than max allowed: "
                    f"{cap} (model.max_logprobs, at most the vocabulary; prompt_logprobs=-1 asks for all of it)")
        if params._lora is not None:
            problem = self._lora_problem(params._lora)
            if problem is not None:
                return problem
        if params.thinking_token_budget is not None and not config.reasoning_enabled:
            return "thinking_token_budget needs a reasoning section (start/end) in the engine config"
        if params.n > config.rows_per_worker:
            return (f"n={params.n} siblings share one worker's blocks, which holds at most "
                    f"{config.rows_per_worker} rows (scheduler.max_num_seqs_per_worker)")
        try:
            params.update_from_generation_config(self.model.generation_config, self.model.eos_token_id)
            params.update_from_tokenizer(self.tokenizer)
            Sampler.validate(params, vocab)
            validate_logits_processors_parameters(config.custom_processors, params,
                                                  config.processors_from_entry_points)
            for spec in config.custom_processors:
                if _is_request_level(spec):
                    check_request_setting(spec.kwargs, params)
        except ValueError as exc:
            return str(exc)
        except Exception as exc:  # a custom validate_params that is not a ValueError
            return f"{type(exc).__name__}: {exc}"
        params.assign_request_key(request_id, config.seed)
        return None

    # ----- structured-output constraints -----

    def compile_later(self, request: Request) -> None:
        """Compile a new constraint off the step loop (``coordinator.intake.grammar_check``: in a child process,
        bounded in time and memory); the request is admitted once it has compiled.

        Compiling also validates: a bad schema, regex or grammar fails only its request."""
        constraint = request.params.structured_outputs
        if constraint is None or self._grammars().cached(constraint):
            return
        request.grammar = self._grammars().submit(constraint)
        self._compiling.append(request)

    def failed_constraints(self) -> list[tuple[Request, str]]:
        """Waiting requests whose constraint failed to compile, with the error (only those still
        compiling are looked at, not the whole queue)."""
        if not self._compiling:
            return []
        still, failed = [], []
        for request in self._compiling:
            if request.grammar is None or request.status != RequestStatus.WAITING:
                continue
            if not request.grammar.done():
                still.append(request)
                continue
            error = request.grammar.exception()
            request.grammar = None
            if error is not None:
                failed.append((request, str(error)))
        self._compiling = still
        return failed

    def _grammars(self) -> GrammarCheck:
        if self._grammar_check is None:
            config = self.config
            self._grammar_check = GrammarCheck(self.tokenizer, self.model.vocab_size, config.grammar_compile_timeout_s,
                                               config.grammar_compile_max_memory, config.grammar_cache_size)
        return self._grammar_check


def _is_request_level(spec: Any) -> bool:
    processor = getattr(spec, "processor", None)
    return processor == "processors.builtins.request_level:RequestLevelAdapter" or processor is RequestLevelAdapter

