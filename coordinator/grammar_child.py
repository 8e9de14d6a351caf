"""The grammar compiler process (``coordinator.grammar_check``): compiles constraints sent on its pipe.

It receives the tokenizer's xgrammar description once, answers ``("ready", None)``, then one
``("ok", None)`` or ``("error", reason)`` per constraint. It ends when the pipe closes.
"""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection


def serve(conn: Connection) -> None:
    try:
        import xgrammar as xgr

        from processors.grammar_processor import GrammarCache
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
            fields = conn.recv()
        except EOFError:
            return
        try:
            cache.compile(StructuredOutputsParams.from_value(fields))
        except ValueError as exc:
            conn.send(("error", str(exc)))
        else:
            conn.send(("ok", None))


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
