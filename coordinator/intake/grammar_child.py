"""The grammar compiler process (``coordinator.intake.grammar_check``): compiles constraints sent on its pipe.

It receives the tokenizer's xgrammar description once, answers ``("ready", None)``, then for each
``(constraint fields, CPU seconds it may use)`` one ``("ok", None)`` or ``("error", reason)``. It
ends when the pipe closes.
"""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection


def limit_cpu(seconds: float) -> None:
    """The kernel ends this process once the compile has used ``seconds`` more CPU time (SIGXCPU). The
    parent kills it sooner at its wall-clock bound; this bound holds when the parent is gone (a killed
    coordinator), so an orphaned compile cannot run on for minutes."""
    try:
        import resource

        used = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(used.ru_utime + used.ru_stime + seconds) + 1
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
    except (ImportError, ValueError, OSError):
        pass  # no such limit here: the parent's bound alone


def serve(conn: Connection) -> None:
    try:
        import xgrammar as xgr

        from processors.builtins.grammar_processor import GrammarCache
        from processors.structured_outputs import StructuredOutputsParams

        cache = GrammarCache(None, 0, 1, info=xgr.TokenizerInfo.deserialize_json(conn.recv()))
    except EOFError:
        return
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            fields, cpu_s = conn.recv()
        except EOFError:
            return
        limit_cpu(cpu_s)
        try:
            cache.compile(StructuredOutputsParams.from_value(fields))
        except ValueError as exc:
            conn.send(("error", str(exc)))
        else:
            conn.send(("ok", None))


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
