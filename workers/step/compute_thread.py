"""The one thread a process runs its model work on: loading, forwards and sampling.

Why one: each thread that runs a parallel torch op on CPU keeps an OpenMP team of its own,
and once a process holds more OpenMP threads than cores, libgomp stops letting idle team
threads spin and puts them to sleep after every op. Then each of a step's ~5,000 small ops
pays a wake-up. Measured on SmolLM2-135M in bfloat16 (2 cores), a 64-row decode step takes
101 ms when one thread runs all of them and 135 ms once a second thread has run a forward.
The step loop, the executor's timeout and the pipelined step each need threads of their own;
they hand their torch work to this one instead of running it.

A job that hangs (a processor stuck for one request) holds the thread: ``abandon`` gives up on
it, and the next call gets a new thread; the old one runs nothing more when it wakes.
"""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

T = TypeVar("T")

_lock = threading.Lock()
_current: ComputeThread | None = None
_exiting = False  # set at interpreter exit: no new thread starts after it
_threads: int | None = None  # intra-op threads the compute thread runs with (workers.step.threads)


class ComputeThread:
    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._abandoned = False
        self._thread = threading.Thread(target=self._serve, name="raysample-compute", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future:
        """Run ``fn`` on this thread after the jobs already given to it; returns at once."""
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def start(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future:
        """``submit``, except that on this thread itself ``fn`` runs now: a job there cannot wait
        for one queued behind it."""
        if threading.current_thread() is not self._thread:
            return self.submit(fn, *args, **kwargs)
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # the caller re-raises it
            future.set_exception(exc)
        return future

    def is_current(self) -> bool:
        """Whether the caller is this thread."""
        return threading.current_thread() is self._thread

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn``'s result, computed on this thread (here and now when called from it)."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def drain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the jobs already given to end; the thread stays, idle."""
        try:
            self.submit(lambda: None).result(timeout_s)
        except Exception:  # noqa: BLE001 - timed out or cancelled: nothing more to wait for
            pass

    def abandon(self) -> None:
        """Run nothing more: jobs still queued are cancelled once the current one ends."""
        self._abandoned = True
        self._jobs.put(None)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                break
            if self._abandoned:
                job[0].cancel()
                break
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            if _threads is not None and torch.get_num_threads() != _threads:
                torch.set_num_threads(_threads)
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # the caller re-raises it
                future.set_exception(exc)
        while True:  # abandoned: cancel what is left, so that no waiter waits for ever
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job[0].cancel()


def compute_thread() -> ComputeThread:
    """This process's compute thread, started on first use."""
    global _current
    with _lock:
        if _current is None:
            if _exiting:
                raise RuntimeError("the process is exiting: no model work starts now")
            _current = ComputeThread()
        return _current


def abandon_compute_thread() -> None:
    """After a job hung: the next ``compute_thread()`` is a new thread."""
    global _current
    with _lock:
        if _current is not None:
            _current.abandon()
        _current = None


@atexit.register
def _drain_at_exit() -> None:
    """A forward launched ahead may still run at exit, and native code running on while the interpreter
    tears down aborts the process: let the queued work end first (a hung job is not waited for long).
    The thread is left idle, not ended: a thread ending frees its OpenMP team in a thread-exit
    destructor, which would race the process's own exit-time destructors."""
    global _exiting
    with _lock:
        _exiting, current = True, _current
    if current is not None:
        current.drain(timeout_s=30.0)


def set_compute_threads(threads: int) -> None:
    """The intra-op thread count the compute thread takes before its next job."""
    global _threads
    _threads = threads
