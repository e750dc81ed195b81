"""A bounded cache of plans keyed by frozen step shapes, which never detaches a plan in use.

Serving engines capture one CUDA graph per batch size and keep replaying it: the graph reads the
buffers of the plan it was captured with, and each step's `plan()` must refresh *that* plan. So
the cache holds at most `max_plans` plans strongly (least recently used beyond that are
released), but a released plan that someone still holds stays reachable through a weak
reference: asking for its key again returns the same object, refreshed, instead of building a
second plan that the held one would silently fall behind.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from msa.errors import MSAInputError, is_int

__all__ = ["PlanCache"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class PlanCache(Generic[K, V]):
    """Plans by key. The same key returns the same plan object for as long as anyone holds it.

    At most `max_plans` plans are held by the cache itself (least recently used released
    first); a released plan still referenced elsewhere (by an engine that captured a graph with
    it) is found again through a weak reference and moved back in (`revivals`).

    Attributes:
        hits, misses, evictions, revivals: counters.
    """

    def __init__(self, max_plans: int = 128) -> None:
        if not is_int(max_plans) or max_plans < 1:
            raise MSAInputError("max_plans", "an int >= 1", repr(max_plans))
        self.max_plans = max_plans
        self._plans: OrderedDict[K, V] = OrderedDict()
        self._released: weakref.WeakValueDictionary[K, V] = weakref.WeakValueDictionary()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.revivals = 0

    def get_or_create(self, key: K, create: Callable[[], V]) -> V:
        """The plan for `key`: the cached one, a released one still alive, or `create()`."""
        plan = self._plans.get(key)
        if plan is not None:
            self.hits += 1
            self._plans.move_to_end(key)
            return plan
        plan = self._released.pop(key, None)
        if plan is not None:
            self.revivals += 1
        else:
            self.misses += 1
            plan = create()
        self._plans[key] = plan
        while len(self._plans) > self.max_plans:
            old_key, old = self._plans.popitem(last=False)
            with contextlib.suppress(TypeError):  # a value that cannot be weakly referenced is dropped
                self._released[old_key] = old
            self.evictions += 1
        return plan

    def get(self, key: K) -> V | None:
        """The plan for `key` if one is alive (cached or held elsewhere), else None."""
        plan = self._plans.get(key)
        return plan if plan is not None else self._released.get(key)

    def __len__(self) -> int:
        return len(self._plans)

    def __contains__(self, key: object) -> bool:
        return key in self._plans

    def keys(self) -> list[K]:
        """Keys of the plans the cache holds, least recently used first."""
        return list(self._plans)

    def values(self) -> list[V]:
        """Every plan still alive: the cache's own and the released ones someone holds."""
        return list(self._plans.values()) + list(self._released.values())

    def clear(self) -> list[V]:
        """Forget every plan; returns those still alive (the caller retires them)."""
        alive = self.values()
        self._plans.clear()
        self._released.clear()
        return alive

    def stats(self) -> str:
        return (
            f"{len(self)}/{self.max_plans} plans, {self.hits} hits, {self.misses} misses, "
            f"{self.evictions} evictions, {self.revivals} revivals"
        )
