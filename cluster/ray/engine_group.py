"""Data-parallel engines (``cluster.num_engines``, vLLM's ``data_parallel_size``) behind one handle.

Each engine is a whole raysample engine: a coordinator with its own workers and
placement group. Requests go to the engine with the least outstanding work (or,
not much busier, to the one that took their prompt's prefix last: its cache holds
it), and an output does not depend on which engine made it: sampling is keyed by the
request's seed or id, and the group gives ids in one sequence as one engine
would. An engine that dies (its coordinator gone, or failed for want of
workers) has its unfinished requests run again, with the same ids, on the
others; a request's final output is delivered once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ray

from cluster.config import RaysampleConfig
from cluster.engine.engine_api import POLL_S, RequestAPI, take_ready
from cluster.engine.prompts import Params, Prompt, PromptInput, as_prompt, params_per_prompt
from cluster.ray.engine_handle import EngineError, EngineGone, EngineHandle
from coordinator.intake.prefix_order import chunk_keys
from coordinator.request import RequestOutput
from processors import SamplingParams

logger = logging.getLogger(__name__)

# Prefix affinity: a prompt goes where its longest known prefix (up to AFFINITY_DEPTH chunks of
# coordinator.intake.prefix_order) went last, unless that engine's outstanding work is more than
# the least loaded one's by AFFINITY_SLACK of it, or by AFFINITY_REQUESTS requests like this one.
AFFINITY_DEPTH = 64
AFFINITY_SLACK = 0.25
AFFINITY_REQUESTS = 4
AFFINITY_KEYS = 1 << 18  # keys remembered, oldest forgotten first


def engine_config(config: RaysampleConfig, index: int) -> RaysampleConfig:
    """Engine ``index`` of a group: one engine, named ``<group>-<index>``."""
    cluster = config.cluster.model_copy(update={"num_engines": 1,
                                                "coordinator_name": f"{config.cluster.coordinator_name}-{index}"})
    return config.model_copy(update={"cluster": cluster})


def work_estimate(prompt: Prompt, params: Any, max_model_len: int) -> int:
    """Tokens a request will cost, roughly: its prompt (4 characters a token for text) plus what it may generate."""
    fed = len(prompt) // 4 + 1 if isinstance(prompt, str) else len(prompt)
    if isinstance(params, SamplingParams):
        max_tokens, n = params.max_tokens, params.n
    elif isinstance(params, dict):
        max_tokens, n = params.get("max_tokens"), params.get("n", 1)
    else:
        max_tokens, n = None, 1
    generated = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else max_model_len - min(fed, max_model_len)
    return fed + generated * (n if isinstance(n, int) and n > 0 else 1)


@dataclass
class Tracked:
    """What the group keeps of an unfinished request, to run it again elsewhere."""

    prompt: Prompt
    params: Any
    final_only: bool
    engine: int
    work: int
    tried: set[int] = field(default_factory=set)
    prefix: list[bytes] = field(default_factory=list)  # the prompt's prefix-tree keys, for affinity


class EngineGroup(RequestAPI):
    """k engines, one handle: the same calls and return types as ``Engine``."""

    def __init__(self, engines: Sequence[EngineHandle], name: str, max_model_len: int) -> None:
        self.engines: list[EngineHandle | None] = list(engines)  # None: dead and released
        self.name = name
        self.max_model_len = max_model_len
        self._lock = threading.RLock()
        self._requests: dict[str, Tracked] = {}
        self._load = [0] * len(engines)  # outstanding work per engine
        self._buffer: dict[str, list[RequestOutput]] = {}  # polled, not yet delivered
        self._polls: dict[int, tuple[Any, bool]] = {}  # engine -> (its poll in flight, finished_only)
        self._next_id = 0
        self.reruns = 0
        self._affinity: dict[bytes, int] = {}  # prefix-tree key -> the engine that last took a prompt with it

    @classmethod
    def from_config(cls, config: RaysampleConfig, kv_note: str | None = None) -> EngineGroup:
        """Start ``cluster.num_engines`` engines at once (Ray joined, memory planned for all of them and
        resources checked by the caller)."""
        k = config.cluster.num_engines
        with ThreadPoolExecutor(k, thread_name_prefix="raysample-engine-start") as pool:
            starting = [pool.submit(EngineHandle.start, engine_config(config, i), kv_note) for i in range(k)]
        engines, failures = [], []
        for future in starting:
            try:
                engines.append(future.result())
            except BaseException as exc:  # noqa: BLE001 - every engine that started is shut down below
                failures.append(exc)
        if failures:
            for engine in engines:
                engine.shutdown()
            raise failures[0]
        return cls(engines, config.cluster.coordinator_name or "raysample", config.model.max_model_len)

    # ----- routing -----

    def _alive(self) -> list[int]:
        return [i for i, e in enumerate(self.engines) if e is not None]

    def _pick(self, tracked: Tracked) -> int:
        """The least loaded engine, or the one that last took this prompt's longest known prefix while it is
        not much busier: a shared prefix stays in one engine's cache instead of being computed by each."""
        choices = [i for i in self._alive() if i not in tracked.tried] or self._alive()
        if not choices:
            raise EngineGone(f"all {len(self.engines)} engines of {self.name!r} are gone")
        least = min(choices, key=lambda i: (self._load[i], i))
        ceiling = self._load[least] + max(AFFINITY_REQUESTS * tracked.work, int(AFFINITY_SLACK * self._load[least]))
        for key in reversed(tracked.prefix):
            home = self._affinity.get(key)
            if home is not None:
                return home if home in choices and self._load[home] <= ceiling else least
        return least

    def _remember(self, tracked: Tracked, index: int) -> None:
        for key in tracked.prefix:
            self._affinity.pop(key, None)
            self._affinity[key] = index  # most recent last
        while len(self._affinity) > AFFINITY_KEYS:
            self._affinity.pop(next(iter(self._affinity)))

    def _send(self, assignments: dict[int, list[tuple[str, Tracked]]]) -> None:
        """Queue each engine's share; an engine found dead here hands its share to the others."""
        while assignments:
            index, items = assignments.popitem()
            engine = self.engines[index]
            try:
                if engine is None:
                    raise EngineGone("released")
                groups: dict[bool, list[tuple[str, Tracked]]] = {}
                for rid, tracked in items:
                    groups.setdefault(tracked.final_only, []).append((rid, tracked))
                for final_only, group in groups.items():
                    engine.submit_many([t.prompt for _, t in group], [t.params for _, t in group],
                                       [rid for rid, _ in group], final_only)
            except EngineGone:
                self._lose(index)
                for rid, tracked in items:
                    assignments.setdefault(self._assign(rid, tracked), []).append((rid, tracked))

    def _assign(self, rid: str, tracked: Tracked) -> int:
        index = self._pick(tracked)
        self._remember(tracked, index)
        tracked.engine = index
        tracked.tried.add(index)
        self._load[index] += tracked.work
        self._requests[rid] = tracked
        return index

    def _lose(self, index: int) -> list[str]:
        """Mark engine ``index`` dead, release what it held, and take back its unfinished requests."""
        engine = self.engines[index]
        if engine is not None:
            self.engines[index] = None
            logger.warning("engine %s is gone; its unfinished requests run again on the other engines", engine.name)
            try:
                engine.release()
            except Exception:  # noqa: BLE001 - its resources may already be gone with it
                logger.debug("releasing engine %s", engine.name, exc_info=True)
        self._polls.pop(index, None)
        self._load[index] = 0
        return [rid for rid, t in self._requests.items() if t.engine == index]

    def _rerun(self, rids: Sequence[str]) -> None:
        assignments: dict[int, list[tuple[str, Tracked]]] = {}
        for rid in rids:
            tracked = self._requests[rid]
            self._load[tracked.engine] = max(0, self._load[tracked.engine] - tracked.work)
            assignments.setdefault(self._assign(rid, tracked), []).append((rid, tracked))
        self.reruns += len(rids)
        self._send(assignments)

    def _finish(self, rid: str) -> None:
        tracked = self._requests.pop(rid, None)
        if tracked is not None:
            self._load[tracked.engine] = max(0, self._load[tracked.engine] - tracked.work)

    # ----- primitives -----

    def submit_many(self, prompts: Sequence[PromptInput], sampling_params: Params = None,
                    request_ids: Sequence[str | None] | None = None, final_only: bool = False) -> list[str]:
        prompts = [as_prompt(p) for p in prompts]
        params = params_per_prompt(sampling_params, len(prompts))
        given = [rid for rid in request_ids or [] if rid is not None]
        if len(set(given)) != len(given):
            raise ValueError("request ids within one call must be distinct")
        with self._lock:
            in_use = [rid for rid in given if rid in self._requests]
            if in_use:
                raise ValueError(f"request id(s) {in_use} already in use")
            ids, assignments = [], {}
            for prompt, p, rid in zip(prompts, params, request_ids or [None] * len(prompts)):
                if rid is None:
                    rid = f"req-{self._next_id}"  # the sequence one engine would give
                    self._next_id += 1
                tracked = Tracked(prompt, p, final_only, -1, work_estimate(prompt, p, self.max_model_len),
                                  prefix=chunk_keys(prompt, AFFINITY_DEPTH))
                assignments.setdefault(self._assign(rid, tracked), []).append((rid, tracked))
                ids.append(rid)
            try:
                self._send(assignments)
            except Exception:  # nothing of a refused call stays tracked (or polled for)
                for rid in ids:
                    self._finish(rid)
                raise
            return ids

    def abort(self, request_id: str) -> bool:
        with self._lock:
            tracked = self._requests.get(request_id)
            engine = None if tracked is None else self.engines[tracked.engine]
            if engine is None:
                return False
            try:
                return engine.abort(request_id)
            except EngineGone:
                self._rerun(self._lose(tracked.engine))
                return self.abort(request_id)

    def poll(self, request_ids: Sequence[str], timeout_s: float = POLL_S, finished_only: bool = False
             ) -> list[RequestOutput]:
        """Every engine is polled at once; answers for other ids are kept for the calls that want them."""
        wanted = list(request_ids)
        deadline = time.monotonic() + timeout_s
        with self._lock:
            unknown = [rid for rid in wanted if rid not in self._requests and rid not in self._buffer]
            if unknown:
                raise KeyError(f"unknown request id(s) (or their final output was already delivered): {unknown}")
        while True:
            with self._lock:
                ready = take_ready(self._buffer, wanted, finished_only)
                remaining = deadline - time.monotonic()
                if ready or remaining <= 0:
                    return ready
                self._start_polls(remaining, finished_only)
                if not self._polls and not self._alive():
                    raise EngineGone(f"all {len(self.engines)} engines of {self.name!r} are gone")
                refs = {ref: i for i, (ref, _) in self._polls.items()}
            if not refs:
                return []
            # Outside the lock: other callers may submit, abort or poll meanwhile.
            done, _ = ray.wait(list(refs), num_returns=1, timeout=remaining + 0.2)
            if done:  # every answer already in, not only the first
                done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
            with self._lock:
                for ref in done:
                    self._collect(refs[ref], ref)

    def _start_polls(self, timeout_s: float, finished_only: bool) -> None:
        """One poll in flight per engine that has unfinished requests."""
        by_engine: dict[int, list[str]] = {}
        for rid, tracked in self._requests.items():
            by_engine.setdefault(tracked.engine, []).append(rid)
        for index, rids in by_engine.items():
            engine = self.engines[index]
            if index in self._polls or engine is None:
                continue
            ref = engine.poll_ref(rids, timeout_s, finished_only)
            self._polls[index] = (ref, finished_only)

    def _collect(self, index: int, ref: Any) -> None:
        if self._polls.get(index, (None,))[0] is not ref:
            return  # another caller has collected it
        del self._polls[index]
        try:
            outs = ray.get(ref)
        except ray.exceptions.RayActorError:
            self._rerun(self._lose(index))
            return
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None) or exc
            if isinstance(cause, KeyError):
                raise EngineError(str(cause)) from None
            # The engine failed as a whole (every worker gone): what it still held runs elsewhere.
            logger.warning("engine %d of %s failed: %s", index, self.name, cause)
            self._rerun(self._lose(index))
            return
        for out in outs:
            tracked = self._requests.get(out.request_id)
            if tracked is None or tracked.engine != index:
                continue  # an answer from an engine the request has since left
            if out.finished and out.error is not None and out.retryable and self._elsewhere(tracked):
                # An engine-side failure: another engine may finish it; an engine that failed as a
                # whole (every worker gone) is dropped with everything it held.
                if self._failed(index):
                    self._rerun(self._lose(index))
                    return
                self._rerun([out.request_id])
                continue
            self._buffer.setdefault(out.request_id, []).append(out)
            if out.finished:
                self._finish(out.request_id)

    def _failed(self, index: int) -> bool:
        engine = self.engines[index]
        try:
            return engine is None or engine.stats().get("error") is not None
        except EngineError:
            return True

    def _elsewhere(self, tracked: Tracked) -> bool:
        return any(i not in tracked.tried for i in self._alive())

    async def stream(self, prompt: PromptInput, sampling_params: Params = None,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Streamed from the least loaded engine; a stream is not moved if its engine dies (it ends in an error)."""
        with self._lock:
            index = self._pick(Tracked(as_prompt(prompt), sampling_params, False, -1, 0))
            engine = self.engines[index]
            if request_id is None:
                request_id = f"req-{self._next_id}"
                self._next_id += 1
        async for out in engine.stream(prompt, sampling_params, request_id):
            yield out

    # ----- the rest of Engine's surface -----

    def stats(self) -> dict[str, Any]:
        """Per engine under ``engines`` (``None`` for a dead one); totals at the top level."""
        with self._lock:
            per: list[dict[str, Any] | None] = []
            for index, engine in enumerate(self.engines):
                if engine is None:
                    per.append(None)
                    continue
                try:
                    per.append({"name": engine.name, **engine.stats()})
                except EngineGone:
                    self._rerun(self._lose(index))
                    per.append(None)
            alive = [s for s in per if s is not None]
            total = {key: sum(s.get(key) or 0 for s in alive)
                     for key in ("running", "waiting", "workers_alive", "steps", "generated_tokens",
                                 "tokens_per_s", "tokens_per_s_lifetime", "spec_proposed", "spec_accepted",
                                 "ahead_rows", "ahead_wasted_rows", "prompt_tokens", "prefill_tokens",
                                 "prefix_hit_tokens", "preemptions")}
            proposed = total["spec_proposed"]
            return {
                **total,
                "spec_acceptance": total["spec_accepted"] / proposed if proposed else None,
                "engines_alive": len(alive),
                "reruns": self.reruns,
                "kv_cache": f"{len(alive)} engines: " + "; ".join(f"{s['name']}: {s['kv_cache']}" for s in alive),
                "engines": per,
            }

    def worker_handles(self) -> list[Any]:
        return [w for e in self.engines if e is not None for w in e.worker_handles()]

    def shutdown(self) -> None:
        with self._lock:
            live = [e for e in self.engines if e is not None]
            self.engines = [None] * len(self.engines)
        with ThreadPoolExecutor(max(len(live), 1), thread_name_prefix="raysample-engine-stop") as pool:
            for future in [pool.submit(e.shutdown) for e in live]:
                try:
                    future.result()
                except EngineError:
                    pass
