"""vLLM's offline ``LLM`` and streaming ``AsyncLLM``, on a raysample engine.

``LLM(model="smollm2-135m-instruct", num_workers=2)`` starts an engine on Ray
(``local=True``: in this process) and answers ``generate`` and ``chat`` as vLLM
does: prompts in any of vLLM's forms, one or one-per-prompt ``SamplingParams``,
``RequestOutput`` objects in prompt order, a progress bar on long calls.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from cluster.config import RaysampleConfig
from cluster.engine.engine_api import RequestAPI
from cluster.engine.prompts import Params, PromptInput, as_prompt_list, params_per_prompt, with_lora
from cluster.entrypoints.chat import load_tokenizer, render_chat
from cluster.entrypoints.engine_factory import build_engine
from cluster.entrypoints.llm_args import config_from_llm_args
from cluster.preflight import prepare_run
from coordinator.request import RequestOutput

Conversation = list[dict[str, Any]]

logger = logging.getLogger("raysample")


def _refuse(name: str, value: Any, why: str) -> None:
    if value is not None:
        raise ValueError(f"{name} is not supported: {why}")


class _EngineOwner:
    """Builds the config and the engine, and owns its shutdown."""

    def __init__(self, model: str | dict[str, Any] | None = None, *,
                 config: RaysampleConfig | dict[str, Any] | str | Path | None = None,
                 local: bool = False, **kwargs: Any) -> None:
        self.config = prepare_run(config_from_llm_args(model, config, **kwargs), local)  # once, for engine and tokenizer
        self.local = local
        self.engine: RequestAPI = build_engine(self.config, local=local)
        self._tokenizer: Any = None

    def get_tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (loaded in this process)."""
        if self._tokenizer is None:
            if self.local:
                self._tokenizer = self.engine.tokenizer  # type: ignore[attr-defined]
            else:
                facts = self.config.facts
                self._tokenizer = load_tokenizer(facts.tokenizer, facts.trust_remote_code)
        return self._tokenizer

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self):  # noqa: ANN204
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class LLM(_EngineOwner):
    """``LLM(model=..., num_workers=..., gpus_per_worker=..., logits_processors=[...], dtype=...,
    max_model_len=..., **other config keys)`` or ``LLM(config="configs/x.yaml")``."""

    def generate(self, prompts: PromptInput | Sequence[PromptInput], sampling_params: Params = None,
                 use_tqdm: bool | Callable[..., Any] = True, lora_request: Any = None,
                 priority: Any = None) -> list[RequestOutput]:
        """``lora_request``: a ``LoRARequest`` for every prompt or a list of one per prompt (None: the base
        model); the engine needs ``enable_lora=True``."""
        _refuse("priority", priority, "requests are scheduled first come, first served")
        return self._run(as_prompt_list(prompts), sampling_params, use_tqdm, lora_request)

    def _run(self, prompts: list[Any], sampling_params: Params, use_tqdm: bool | Callable[..., Any],
             lora_request: Any = None) -> list[RequestOutput]:
        """As vLLM's ``LLM``: a request refused at submission raises (``RequestAPI.generate``'s
        ``raise_refused``); one that fails while running keeps its error, and one warning line counts them."""
        outputs = self.engine.generate(prompts, sampling_params, use_tqdm=use_tqdm, raise_refused=True,
                                       lora_request=lora_request)
        failed = [out for out in outputs if out.error is not None]
        if failed:
            logger.warning("%d of %d requests failed while running; each output's .error says why (the first: %s)",
                           len(failed), len(outputs), failed[0].error)
        return outputs

    def chat(self, messages: Conversation | Sequence[Conversation], sampling_params: Params = None,
             use_tqdm: bool | Callable[..., Any] = True, lora_request: Any = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: Any = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             mm_processor_kwargs: Any = None) -> list[RequestOutput]:
        """One conversation (a list of ``{"role", "content"}``) or a list of them. As in vLLM, a conversation
        that cannot be rendered raises its ValueError before anything runs."""
        _refuse("tools", tools, "tool calling is not supported")
        _refuse("mm_processor_kwargs", mm_processor_kwargs, "multi-modal inputs are not supported")
        conversations = _conversations(messages)
        params = params_per_prompt(sampling_params, len(conversations))
        tokenizer = self.get_tokenizer()
        prompts: list[Any] = []
        for conversation in conversations:
            try:
                prompts.append(render_chat(tokenizer, conversation, chat_template_kwargs, add_generation_prompt,
                                           continue_final_message, chat_template))
            except ValueError as exc:
                prompts.append(exc)
        for rendered in prompts:
            if isinstance(rendered, ValueError):  # vLLM raises for a conversation it cannot render
                raise rendered
        return self._run(prompts, params, use_tqdm, lora_request)

    def beam_search(self, *args: Any, **kwargs: Any) -> list[Any]:
        raise NotImplementedError("beam search is not supported: raysample samples one token per row and step")

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()


class AsyncLLM(_EngineOwner):
    """vLLM's ``AsyncLLM.generate(prompt, sampling_params, request_id)``: an async iterator of outputs."""

    async def generate(self, prompt: PromptInput, sampling_params: Params = None, request_id: str | None = None,
                       lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            raise TypeError("AsyncLLM.generate takes one prompt; call it once per prompt")
        as_prompt_list(prompt)  # the same check of the prompt's form as LLM.generate
        if lora_request is not None:
            sampling_params = with_lora(sampling_params, lora_request, 1)[0]  # type: ignore[index]
        async for out in self.engine.stream(prompt, sampling_params, request_id):
            yield out

    async def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)


def _conversations(messages: Any) -> list[Any]:
    """One conversation or a list of them (told apart as vLLM does: by the first element)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError("messages must be a conversation (a list of {role, content} objects) or a list of "
                        f"conversations; got {type(messages).__name__ if messages is not None else None}")
    if isinstance(messages[0], (list, tuple)):
        return [list(m) if isinstance(m, (list, tuple)) else m for m in messages]
    return [list(messages)]
