"""Input lines as JSON, bounded in nesting: a line nested past the limit is that line's error.

``json.loads`` recurses once per level; a 4 KB line of 2,000 ``[`` raised RecursionError
in the job's reader and ended the job. Parsing stops at the interpreter's own limit
(RecursionError, caught here), and what parses is walked without recursion and held to
``input.max_json_depth``, so nothing deeper reaches templates, processors or pickling.
"""

from __future__ import annotations

import json
from typing import Any

DEPTH_KEY = "input.max_json_depth"


class JSONLineError(ValueError):
    """An input line is not JSON, or not JSON this job accepts."""


def json_depth_over(value: Any, limit: int) -> bool:
    """Whether ``value`` nests objects and arrays more than ``limit`` deep (the line's object is 1)."""
    if not isinstance(value, (dict, list)):
        return False
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def load_json(text: str | bytes, max_depth: int) -> Any:
    """``text`` parsed; ``JSONLineError`` for invalid JSON or nesting past ``max_depth``."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except json.JSONDecodeError as exc:
        raise JSONLineError(f"not valid JSON: {exc}") from None
    if json_depth_over(value, max_depth):
        raise _too_deep(max_depth)
    return value


def _too_deep(max_depth: int) -> JSONLineError:
    return JSONLineError(f"the line nests objects/arrays more than {max_depth} levels deep "
                         f"({DEPTH_KEY}={max_depth}); it was not used")
