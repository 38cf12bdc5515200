"""Duplicate suppression: a bounded, time-windowed memory of handled message ids, with the
semantics of the Rust SDK's ``reach_sdk::dedupe``.

A message redelivered (a retry after a lost reply, a replayed orchestrator step) gets the
outcome of its first delivery and does not run the handler again; a duplicate that arrives
while the first is still running waits for it. Ids are remembered for ``window`` seconds, at
most ``capacity`` of them and at most ``max_bytes`` of outcomes (as :meth:`DedupeCache.charge`
d), the oldest forgotten first.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["DedupeCache", "Slot"]

T = TypeVar("T")


class Slot(Generic[T]):
    """The shared outcome of one message id: empty until an initialisation succeeds."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._value: T | None = None
        self._set = False

    @property
    def is_set(self) -> bool:
        """Whether the outcome is known."""
        return self._set

    def get(self) -> T | None:
        """The outcome, or ``None`` while it is not known."""
        return self._value

    async def get_or_init(self, init: Callable[[], Awaitable[T]]) -> T:
        """The outcome, running ``init`` to produce it when nobody has. Concurrent callers
        wait for the one running ``init``. When ``init`` raises, nothing is remembered and the
        exception propagates: the next caller (a waiting duplicate, or a later redelivery)
        runs ``init`` itself."""
        if not self._set:
            async with self._lock:
                if not self._set:
                    self._value = await init()
                    self._set = True
        return self._value  # type: ignore[return-value]


@dataclass
class _Entry(Generic[T]):
    at: float
    slot: Slot[T]
    bytes: int = 0


class DedupeCache(Generic[T]):
    """Remembers outcomes by message id for ``window`` seconds, at most ``capacity`` ids
    and ``max_bytes`` of charged outcomes. ``clock`` (monotonic seconds) is injectable for
    tests."""

    def __init__(
        self,
        window: float,
        capacity: int,
        max_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._window = window
        self._capacity = max(1, capacity)
        self._max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[str, _Entry[T]] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        """How many ids are remembered."""
        return len(self._entries)

    @property
    def bytes(self) -> int:
        """The bytes charged to the remembered ids."""
        return self._bytes

    def slot(self, message_id: str) -> Slot[T]:
        """The slot for ``message_id``: a new empty one the first time, the same one for every
        repeat within the window. First forgets ids older than the window, and the oldest
        while the cache is at capacity."""
        now = self._clock()
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if now - oldest.at < self._window and len(self._entries) < self._capacity:
                break
            self._forget_oldest()
        entry = self._entries.get(message_id)
        if entry is not None:
            return entry.slot
        slot: Slot[T] = Slot()
        self._entries[message_id] = _Entry(at=now, slot=slot)
        return slot

    def charge(self, message_id: str, size: int) -> None:
        """Charges ``size`` bytes (an outcome's size) to ``message_id``, then forgets the
        oldest ids until the charged total is within ``max_bytes`` again — possibly
        ``message_id`` itself, when its outcome alone is larger. An id no longer remembered
        is not charged."""
        entry = self._entries.get(message_id)
        if entry is None:
            return
        entry.bytes += size
        self._bytes += size
        while self._bytes > self._max_bytes and self._entries:
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self._bytes -= entry.bytes
