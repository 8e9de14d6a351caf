"""Structured-output constraints compiled first in a child process, bounded in time and memory.

A constraint is code of a kind: a 400-level JSON schema took 89 s to compile, and the
requests behind it waited. xgrammar's compiler cannot be interrupted from Python, so a
new constraint is compiled in a child process (``coordinator.intake.grammar_child``) that is
killed when it passes ``structured_outputs.compile_timeout_s`` or grows by more than
``structured_outputs.compile_max_memory``: that request fails with the reason, and no
other waits on it (children run side by side, each check on a daemon thread). What
compiles is remembered here by its key; workers then compile it themselves, and it is
known to finish within the bound.

Children are shared by every coordinator of a process with the same tokenizer (tests
build many engines), and end when this process does (their pipe closes).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any

from processors.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_CHILDREN = 2  # a slow constraint holds one; the next compiles on the other
START_TIMEOUT_S = 120.0  # a child imports xgrammar (and torch) before its first compile
POLL_S = 0.02
CHILD_CPU_FACTOR = 4  # a child ends itself past this many times the time bound in CPU seconds (parent gone)


class GrammarCheck:
    """``submit`` compiles a new constraint in a child; its future fails with a ValueError naming the reason."""

    def __init__(self, tokenizer: Any, vocab_size: int, timeout_s: float, max_memory: int, capacity: int = 256) -> None:
        self.timeout_s = timeout_s
        self.max_memory = max_memory
        self.capacity = capacity
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._pool: ChildPool | None = None
        self._compiled: OrderedDict[tuple, None] = OrderedDict()  # keys that compiled within the bounds
        self._running: dict[tuple, Future] = {}
        self._lock = threading.Lock()

    def cached(self, params: StructuredOutputsParams) -> bool:
        with self._lock:
            return params.key() in self._compiled

    def submit(self, params: StructuredOutputsParams) -> Future:
        key = params.key()
        with self._lock:
            if key in self._running:
                return self._running[key]
            future: Future = Future()
            if key in self._compiled:
                future.set_result(None)
                return future
            self._running[key] = future
        threading.Thread(target=self._check, args=(params, key, future), name="raysample-grammar-check",
                         daemon=True).start()
        return future

    def _check(self, params: StructuredOutputsParams, key: tuple, future: Future) -> None:
        try:
            self.pool().compile(params, self.timeout_s, self.max_memory)
        except BaseException as exc:  # noqa: BLE001 - the request's error
            error = exc if isinstance(exc, ValueError) else ValueError(f"{type(exc).__name__}: {exc}")
            with self._lock:
                del self._running[key]
            future.set_exception(error)
            return
        with self._lock:
            del self._running[key]
            self._compiled[key] = None
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        future.set_result(None)

    def pool(self) -> ChildPool:
        if self._pool is None:
            self._pool = ChildPool.for_tokenizer(self._tokenizer, self._vocab_size)
        return self._pool


class ChildPool:
    """Up to ``MAX_CHILDREN`` compiler processes for one tokenizer; a child killed for a bound is replaced."""

    _pools: dict[str, ChildPool] = {}
    _pools_lock = threading.Lock()

    def __init__(self, info_json: str) -> None:
        self.info_json = info_json
        self._idle: list[Child] = []
        self._count = 0
        self._free = threading.Condition()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int) -> ChildPool:
        import xgrammar as xgr

        info_json = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size).serialize_json()
        digest = hashlib.sha256(info_json.encode()).hexdigest()
        with cls._pools_lock:
            if digest not in cls._pools:
                cls._pools[digest] = cls(info_json)
            return cls._pools[digest]

    def compile(self, params: StructuredOutputsParams, timeout_s: float, max_memory: int) -> None:
        child = self._acquire()
        try:
            child.compile(params, timeout_s, max_memory)
        except ChildLost:
            self._lose(child)
            raise
        except ValueError:  # the constraint does not compile; the child is fine
            self._release(child)
            raise
        except BaseException:
            self._lose(child)
            raise
        self._release(child)

    def _acquire(self) -> Child:
        with self._free:
            while not self._idle and self._count >= MAX_CHILDREN:
                self._free.wait()
            if self._idle:
                return self._idle.pop()
            self._count += 1
        try:
            return Child.start(self.info_json)
        except BaseException:
            with self._free:
                self._count -= 1
                self._free.notify()
            raise

    def _release(self, child: Child) -> None:
        with self._free:
            self._idle.append(child)
            self._free.notify()

    def _lose(self, child: Child) -> None:
        child.kill()
        with self._free:
            self._count -= 1
            self._free.notify()


class ChildLost(ValueError):
    """The child was stopped (a bound) or died; the message is the request's error."""


class Child:
    """One compiler process and its pipe."""

    def __init__(self, proc: subprocess.Popen, conn: Connection) -> None:
        self.proc = proc
        self.conn = conn
        self.baseline = 0

    @classmethod
    def start(cls, info_json: str) -> Child:
        ours, theirs = Pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        proc = subprocess.Popen([sys.executable, "-m", "coordinator.intake.grammar_child", str(theirs.fileno())],
                                pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL)
        theirs.close()
        child = cls(proc, ours)
        try:
            ours.send(info_json)
            if not ours.poll(START_TIMEOUT_S):
                raise RuntimeError(f"it did not start within {START_TIMEOUT_S:.0f}s")
            status, message = ours.recv()
            if status != "ready":
                raise RuntimeError(message)
        except (EOFError, OSError, RuntimeError) as exc:
            child.kill()
            raise ValueError(f"structured outputs: the grammar compiler process could not start: {exc}") from None
        child.baseline = resident_bytes(proc.pid) or 0
        return child

    def compile(self, params: StructuredOutputsParams, timeout_s: float, max_memory: int) -> None:
        kind = params.kind
        fields = params.to_dict()
        if isinstance(fields.get("json"), dict):  # as text: pickle recurses once per level, JSON text does not
            try:
                fields["json"] = json.dumps(fields["json"])
            except RecursionError:
                raise ValueError("structured_outputs.json nests too deeply to compile") from None
        try:  # CPU time for the child's own bound: the compiler's threads can use more than the wall time
            self.conn.send((fields, CHILD_CPU_FACTOR * timeout_s + 5.0))
        except OSError as exc:
            raise ChildLost(f"structured_outputs.{kind} could not be compiled: the compiler process is gone ({exc})")
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(POLL_S):
            if time.monotonic() > deadline:
                raise ChildLost(f"structured_outputs.{kind} took more than {timeout_s:g}s to compile "
                                "(structured_outputs.compile_timeout_s); its compilation was stopped")
            grown = (resident_bytes(self.proc.pid) or 0) - self.baseline
            if grown > max_memory:
                raise ChildLost(f"structured_outputs.{kind} needed more than {max_memory >> 20} MiB to compile "
                                "(structured_outputs.compile_max_memory); its compilation was stopped")
            if self.proc.poll() is not None:
                raise ChildLost(f"structured_outputs.{kind} could not be compiled: the compiler process exited "
                                f"with code {self.proc.returncode}")
        try:
            status, message = self.conn.recv()
        except (EOFError, OSError):
            raise ChildLost(f"structured_outputs.{kind} could not be compiled: the compiler process exited "
                            f"with code {self.proc.wait()}") from None
        if status == "error":
            raise ValueError(message)

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            logger.warning("a grammar compiler process (pid %d) did not end", self.proc.pid)
        self.conn.close()


def resident_bytes(pid: int) -> int | None:
    """Resident memory of ``pid`` from /proc (None where there is no /proc: then time is the only bound)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
