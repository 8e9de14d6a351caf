"""What every engine handle shares: the Ray ``Engine``, an ``EngineGroup`` of several, and
the in-process ``LocalEngine``.

Each takes vLLM's prompt forms and keywords and returns the same types; each
implements the primitives (``submit_many``, ``poll``, ``abort``, an async ``stream``,
``stats``, ``shutdown``) and gets the rest from here: ``submit``, ``results`` and a
``generate`` with vLLM's progress bar.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from cluster.engine.prompts import Params, PromptInput, as_prompt_list, with_lora
from coordinator.request import RequestOutput

POLL_S = 1.0


class RequestAPI(ABC):
    # ----- primitives -----

    @abstractmethod
    def submit_many(self, prompts: Sequence[PromptInput], sampling_params: Params = None,
                    request_ids: Sequence[str | None] | None = None, final_only: bool = False) -> list[str]:
        """Queue prompts; their request ids. ``final_only``: only final outputs are built (vLLM's FINAL_ONLY)."""
        raise NotImplementedError

    @abstractmethod
    def poll(self, request_ids: Sequence[str], timeout_s: float = POLL_S, finished_only: bool = False
             ) -> list[RequestOutput]:
        """Outputs of these requests since the last poll (waits up to ``timeout_s``);
        ``finished_only`` skips intermediate ones."""
        raise NotImplementedError

    @abstractmethod
    def abort(self, request_id: str) -> bool:
        raise NotImplementedError

    @abstractmethod
    def stream(self, prompt: PromptInput, sampling_params: Params = None,
               request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """``async for out in engine.stream(...)``: each output as it is made; leaving early aborts."""
        raise NotImplementedError

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Running/waiting requests, throughput, KV usage, ``kv_cache`` (the start-up line)."""
        raise NotImplementedError

    @abstractmethod
    def shutdown(self) -> None:
        raise NotImplementedError

    # ----- shared -----

    def submit(self, prompt: PromptInput, sampling_params: Params = None, request_id: str | None = None,
               lora_request: Any = None) -> str:
        params = [sampling_params] if isinstance(sampling_params, dict) else sampling_params
        return self.submit_many([prompt], with_lora(params, lora_request, 1), [request_id])[0]

    def run(self, request_ids: Sequence[str]) -> Iterator[RequestOutput]:
        """These requests' outputs as they change, until each has finished (a synchronous stream)."""
        pending = set(request_ids)
        while pending:
            for out in self.poll(sorted(pending), POLL_S):
                if out.finished:
                    pending.discard(out.request_id)
                yield out

    def results(self, request_ids: Sequence[str], on_finished: Callable[[RequestOutput], None] | None = None
                ) -> dict[str, RequestOutput]:
        """Block until these requests finish; their final outputs by id."""
        pending, final = set(request_ids), {}
        while pending:
            for out in self.poll(sorted(pending), POLL_S * 10, finished_only=True):
                if out.finished and out.request_id in pending:
                    final[out.request_id] = out
                    pending.discard(out.request_id)
                    if on_finished is not None:
                        on_finished(out)
        return final

    def generate(self, prompts: PromptInput | Sequence[PromptInput], sampling_params: Params = None,
                 use_tqdm: bool | Callable[..., Any] = False, raise_refused: bool = False,
                 lora_request: Any = None) -> list[RequestOutput]:
        """Run prompts to completion (blocking); outputs in prompt order.

        ``use_tqdm``: a progress bar as vLLM's (``True``, or a tqdm-like class to build it).
        ``lora_request``: a ``LoRARequest`` for every prompt, or a list of one per prompt (``with_lora``).
        ``raise_refused``: as vLLM's ``LLM``, a request refused at submission (``RequestOutput.refused``)
        raises its ValueError before any output, and the others are aborted; else it is an error output.
        """
        prompts = as_prompt_list(prompts)
        ids = self.submit_many(prompts, with_lora(sampling_params, lora_request, len(prompts)), final_only=True)
        early: dict[str, RequestOutput] = {}
        if raise_refused:  # refusals are final at once: one poll without waiting finds them
            early = {out.request_id: out for out in self.poll(ids, 0.0, finished_only=True)}
            refused = next((early[rid] for rid in ids if rid in early and early[rid].refused), None)
            if refused is not None:
                for rid in ids:
                    if rid not in early:
                        self.abort(rid)
                raise ValueError(refused.error)
        with ProgressBar(len(ids), use_tqdm) as bar:
            for out in early.values():
                bar.finished(out)
            final = {**early, **self.results([rid for rid in ids if rid not in early], bar.finished)}
        return [final[rid] for rid in ids]


def take_ready(outputs: dict[str, list[RequestOutput]], wanted: Sequence[str], finished_only: bool
               ) -> list[RequestOutput]:
    """Remove and return the buffered outputs of ``wanted`` (only final ones if ``finished_only``):
    what a poll delivers, on Ray and in process alike."""
    ready: list[RequestOutput] = []
    for rid in wanted:
        outs = outputs.get(rid)
        if not outs:
            continue
        if finished_only:
            if outs[-1].finished:
                ready.append(outs[-1])
                del outputs[rid]
        else:
            ready.extend(outputs.pop(rid))
    return ready


class ProgressBar:
    """vLLM's "Processed prompts" bar with prompt and generated tokens per second; a no-op when off."""

    def __init__(self, total: int, use_tqdm: bool | Callable[..., Any]) -> None:
        self.bar = None
        self.started = time.perf_counter()
        self.prompt_tokens = self.output_tokens = 0
        if use_tqdm and total:
            factory = use_tqdm if callable(use_tqdm) else _tqdm()
            self.bar = factory(total=total, desc="Processed prompts", dynamic_ncols=True,
                               postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")

    def finished(self, out: RequestOutput) -> None:
        if self.bar is None:
            return
        self.prompt_tokens += len(out.prompt_token_ids)
        self.output_tokens += sum(len(c.token_ids) for c in out.outputs)
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.bar.postfix = (f"est. speed input: {self.prompt_tokens / elapsed:.2f} toks/s, "
                            f"output: {self.output_tokens / elapsed:.2f} toks/s")
        self.bar.update(1)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def _tqdm() -> Callable[..., Any]:
    from tqdm.auto import tqdm

    return tqdm
