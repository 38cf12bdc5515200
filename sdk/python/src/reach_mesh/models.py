"""Model (LLM) call slots: how many model calls an agent runs at once and how many more it
could start, reported in every heartbeat so the router balances model-bound agents by their
model's load (``reach_sdk::ModelSlots``).

Wrap each model call in a slot::

    async with ctx.model_slots.acquire():   # waits while every slot is taken
        answer = await model.complete(prompt)

With a limit (``AgentConfig.model_slots``) heartbeats report ``model_calls_in_flight`` and
``model_slots_free``, the instance reports BUSY while every slot is taken, and a change into
or out of that state sends a heartbeat at once. Without one (0) slots never wait and nothing
is reported, unless the agent reports its own figures with :meth:`ModelSlots.set`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Final

__all__ = ["MAX_REPORTED", "ModelLoad", "ModelSlots"]

#: The most a heartbeat may report for either figure (the registry refuses more).
MAX_REPORTED: Final = 1_000_000


@dataclass(frozen=True)
class ModelLoad:
    """The model load an instance reports: calls in flight and slots free."""

    in_flight: int = 0
    free: int = 0

    @property
    def saturated(self) -> bool:
        """Whether every slot is taken while calls run: the instance reports BUSY."""
        return self.in_flight > 0 and self.free == 0


class ModelSlots:
    """The model call slots of one agent instance (``limit`` of them; 0: unlimited and
    unreported). Shared by every handler through :attr:`HandlerContext.model_slots`."""

    def __init__(self, limit: int = 0) -> None:
        self._limit = max(0, min(limit, MAX_REPORTED))
        self._permits = asyncio.Semaphore(self._limit) if self._limit else None
        self._in_flight = 0
        self._reported: ModelLoad | None = None
        self._saturated = False
        self._changed = asyncio.Event()

    @property
    def limit(self) -> int:
        """The most model calls at once (0: unlimited)."""
        return self._limit

    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[None]:
        """Holds a slot for the body of ``async with``, waiting while every slot is taken.
        Cancelling the wait takes nothing."""
        if self._permits is not None:
            await self._permits.acquire()
        with self._held(self._permits is not None):
            yield

    @contextlib.asynccontextmanager
    async def try_acquire(self) -> AsyncIterator[bool]:
        """Holds a slot for the body of ``async with`` when one is free now: the ``as`` value
        is ``True`` then, and ``False`` (nothing held, nothing waited for) when every slot is
        taken."""
        if self._permits is not None:
            if self._permits.locked():
                yield False
                return
            # Not locked: acquire() takes the free permit without suspending.
            await self._permits.acquire()
        with self._held(self._permits is not None):
            yield True

    @contextlib.contextmanager
    def _held(self, with_permit: bool) -> Iterator[None]:
        self._in_flight += 1
        self._note_change()
        try:
            yield
        finally:
            self._in_flight -= 1
            if with_permit and self._permits is not None:
                self._permits.release()
            self._note_change()

    def set(self, in_flight: int, free: int) -> None:
        """Reports the agent's own figures (each clamped to 0..:data:`MAX_REPORTED`) instead
        of the slots' count, for a model client that keeps its own limits; every later
        heartbeat sends them until the next ``set``."""
        self._reported = ModelLoad(
            in_flight=max(0, min(in_flight, MAX_REPORTED)), free=max(0, min(free, MAX_REPORTED))
        )
        self._note_change()

    def load(self) -> ModelLoad:
        """What the next heartbeat reports: :meth:`set`'s figures if any, else the slots'
        (zeros when unlimited)."""
        if self._reported is not None:
            return self._reported
        if self._permits is None:
            return ModelLoad()
        return ModelLoad(in_flight=self._in_flight, free=self._limit - self._in_flight)

    async def changed(self) -> None:
        """Returns at the next change into or out of saturation (for the heartbeat loop)."""
        await self._changed.wait()
        self._changed.clear()

    def _note_change(self) -> None:
        saturated = self.load().saturated
        if saturated != self._saturated:
            self._saturated = saturated
            self._changed.set()
