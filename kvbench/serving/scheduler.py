"""Which request a service admits next, which it turns away, and which running one yields to a pool outgrown.

The service asks between two decode steps, with nothing prefilling: `admission` sees the queue (in arrival order,
a preempted request back at its front), the running requests (in admission order) and whether a request's cache
fits the pool beside what the admitted ones hold; after a step that outgrew the pool, `preempted` names the
running request to recompute. Another policy of scheduling (shortest prompt first, priorities) is one class.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvbench.serving.requests import Request


class Admission(NamedTuple):
    """What the scheduler decided: admit `request`, or reject it (`rejected`: why, one of `REJECTED`)."""

    request: Request
    rejected: str | None = None


class Scheduler:
    """The interface a service schedules through."""

    def admission(self, queue: Sequence[Request], running: Sequence[Request],
                  fits: Callable[[Request], bool]) -> Admission | None:
        """The queued request to admit or reject now; None: none yet (it waits for room)."""
        raise NotImplementedError

    def preempted(self, running: Sequence[Request]) -> Request:
        """The running request that goes back to the queue when decoding outgrew the pool."""
        raise NotImplementedError


class FirstComeFirstServed(Scheduler):
    """vLLM's default: the head of the queue is admitted once it fits and nothing jumps it; one that does not fit
    even an idle service's pool is rejected; the newest running request is preempted first."""

    def admission(self, queue: Sequence[Request], running: Sequence[Request],
                  fits: Callable[[Request], bool]) -> Admission | None:
        if not queue:
            return None
        head = queue[0]
        if fits(head):
            return Admission(head)
        return None if running else Admission(head, "larger than the pool")

    def preempted(self, running: Sequence[Request]) -> Request:
        return running[-1]
