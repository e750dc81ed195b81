"""A bounded, least-recently-used cache of plans keyed by frozen step shapes."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["PlanCache"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class PlanCache(Generic[K, V]):
    """Plans by key. The same key returns the same plan object; beyond `max_plans` the least
    recently used plan is dropped (a caller still holding it keeps it alive and valid).

    Attributes:
        hits, misses, evictions: counters.
    """

    def __init__(self, max_plans: int = 32) -> None:
        if max_plans < 1:
            raise ValueError(f"max_plans: expected >= 1, got {max_plans}")
        self.max_plans = max_plans
        self._plans: OrderedDict[K, V] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get_or_create(self, key: K, create: Callable[[], V]) -> V:
        """The plan for `key`, built by `create()` on a miss."""
        if key in self._plans:
            self.hits += 1
            self._plans.move_to_end(key)
            return self._plans[key]
        self.misses += 1
        plan = create()
        self._plans[key] = plan
        while len(self._plans) > self.max_plans:
            self._plans.popitem(last=False)
            self.evictions += 1
        return plan

    def __len__(self) -> int:
        return len(self._plans)

    def __contains__(self, key: object) -> bool:
        return key in self._plans

    def keys(self) -> list[K]:
        """Keys, least recently used first."""
        return list(self._plans)

    def clear(self) -> None:
        self._plans.clear()

    def stats(self) -> str:
        return (
            f"{len(self)}/{self.max_plans} plans, {self.hits} hits, {self.misses} misses, "
            f"{self.evictions} evictions"
        )
