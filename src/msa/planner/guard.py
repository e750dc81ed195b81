"""A planner's one-thread rule, enforced: `plan()` and `run()` hold one lock (never waited for: a
second thread raises), and `run()` checks a plan's owner, state and refreshing thread inside
that same lock, together with the launch — so no `plan()` from another thread can slip in
between the check and the kernels that read the plan's tables."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from msa.errors import MSAInputError
from msa.planner.plans import DecodePlan

__all__ = ["OneThreadGuard", "thread_token"]

_LOCAL = threading.local()


def thread_token() -> object:
    """An object unique to the calling thread, which no other thread ever gets while a plan holds
    it (`threading.get_ident()` is handed to a new thread once a thread exits: a plan refreshed by
    a thread that has since ended would pass as the new thread's)."""
    token = getattr(_LOCAL, "token", None)
    if token is None:
        token = _LOCAL.token = object()
    return token


class OneThreadGuard:
    """The lock of one planner and the checks a plan passes before it runs."""

    def __init__(self, owner: str) -> None:
        self.owner = owner  # the planner's class name, for messages
        self._lock = threading.Lock()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the planner for one call; raise if another thread holds it (a planner is not
        thread-safe, and waiting would only hide the misuse)."""
        if not self._lock.acquire(blocking=False):
            raise MSAInputError(
                self.owner, "use from one thread at a time", "a call while another thread is using it",
                f"A {self.owner} serves one thread: create one per thread (msa.sparse_decode does).",
            )
        try:
            yield
        finally:
            self._lock.release()

    @staticmethod
    def claim(plan: DecodePlan) -> None:
        """Record that this thread's `plan()` refreshed `plan` (call inside `exclusive`)."""
        plan.thread = thread_token()

    def check(self, plan: object, token: object) -> DecodePlan:
        """`plan` as a plan this planner (`token`) may run now, from this thread (call inside
        `exclusive`, in the same hold as the launch)."""
        if not isinstance(plan, DecodePlan):
            raise MSAInputError("plan", f"a DecodePlan from {self.owner}.plan", type(plan).__name__)
        if plan.owner is not token:
            raise MSAInputError(
                "plan", "a plan made by this planner", f"a plan of another planner ({plan.key.describe()})",
                "Run each plan with the planner that made it.",
            )
        if plan.retired:
            raise MSAInputError(
                "plan", "a live plan", f"a plan retired by {self.owner}.clear()",
                "Call plan() again and capture new graphs with the plan it returns.",
            )
        if plan.thread is not thread_token():
            raise MSAInputError(
                "plan", "a plan refreshed by this thread's last plan() call",
                "a plan last refreshed by another thread (its tables describe that thread's step)",
                f"A {self.owner} serves one thread: create one per thread.",
            )
        return plan
