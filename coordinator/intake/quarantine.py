"""Finding the request that makes the engine fail, without failing anyone else.

When a step raises and no request alone can be blamed, or a worker dies or hangs, every request
that was present (the step's batch, or the dead worker's rows) is a suspect. Re-running the same
set would fail the same way, forever. Instead suspects are split into halves and each half runs
with no other request beside it, one after another: a half that finishes clears its members, a
half that fails again is split again. The rule: a request fails, with an error that is not
retryable, once it has been present at ``FAIL_AFTER`` failures or more and was alone at the
last one. A poison request is thus found after about log2(suspects) failures; everyone else
finishes, and (counter-based sampling) with exactly the tokens of a clean run. A single failure
alone is retried once: a node that dies for its own reasons does not condemn the request on it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

FAIL_AFTER = 2  # failures present at, the last one alone


class EngineFault(RuntimeError):
    """A failure every request shares (the model, a kernel, the cache): not any request's fault. The
    engine stops; what it was running fails as retryable, so a resumed job runs it again."""


class Quarantine:
    """Suspect requests (by the caller's request id), in groups run one at a time."""

    def __init__(self) -> None:
        self.failures: dict[str, int] = {}  # request id -> failures it was present at
        self.groups: deque[list[str]] = deque()  # groups waiting to run, first runs next
        self.active: set[str] | None = None  # the group running now, with no one beside it
        # Convicted, not yet failed: the engine checks itself first (``Coordinator.settle_convictions``).
        self.held: dict[str, str] = {}  # request id -> the failure's cause

    def __bool__(self) -> bool:
        return self.active is not None or bool(self.groups)

    def admits(self, request_id: str) -> bool:
        """Whether a request may be scheduled: while suspects run, only the active group's."""
        if request_id in self.held:
            return False
        if not self:
            return True
        if self.active is None:
            self.active = set(self.groups.popleft())
        return request_id in self.active

    def failed(self, present: Iterable[str]) -> list[str]:
        """A failure no request alone explains happened with ``present`` running. Returns the
        requests to fail now (present alone, for the ``FAIL_AFTER``-th time or later); the others
        become suspects, re-run in halves."""
        present = list(dict.fromkeys(present))
        for request_id in present:
            self.failures[request_id] = self.failures.get(request_id, 0) + 1
        if self.active is not None:  # members of the running group that were not present stay suspects
            left = [r for r in self.active if r not in present]
            if left:
                self.groups.appendleft(left)
            self.active = None
        if len(present) == 1 and self.failures[present[0]] >= FAIL_AFTER:
            return present
        half = (len(present) + 1) // 2
        for group in (present[half:], present[:half]):  # the first half runs first
            if group:
                self.groups.appendleft(group)
        return []

    def finished(self, request_id: str) -> None:
        """A request left the engine (done, failed, aborted): it is no longer a suspect."""
        self.failures.pop(request_id, None)
        self.held.pop(request_id, None)
        if self.active is not None:
            self.active.discard(request_id)
            if not self.active:
                self.active = None
        for group in self.groups:
            if request_id in group:
                group.remove(request_id)
        while self.groups and not self.groups[0]:
            self.groups.popleft()
        if self.groups and any(not g for g in self.groups):
            self.groups = deque(g for g in self.groups if g)

    @staticmethod
    def message(cause: str) -> str:
        return (f"this request made the engine fail on its own: it was the only suspect left at a failure "
                f"({cause}); not retried")
