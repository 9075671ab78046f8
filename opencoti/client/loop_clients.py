"""One ``httpx.AsyncClient`` per event loop, each closed with its loop or when its owner is dropped.

An AsyncClient's connections belong to the event loop that opened them, so an async transport used
under several loops (``asyncio.run`` called again and again) keeps one client per loop. Each client
is closed, sockets included (no ``ResourceWarning``):

* when its loop shuts down through ``asyncio.run`` / ``asyncio.Runner`` (or any code that awaits
  ``loop.shutdown_asyncgens()`` before ``loop.close()``): a small guard async generator, started on
  that loop for the client, is closed there and its ``finally`` awaits the client's ``aclose()``;
* when the owner is dropped while the loop still runs: the guard is collected and the loop's
  async-generator finalizer schedules the same close on the loop;
* on ``aclose()`` awaited in that loop.

A loop closed without ``shutdown_asyncgens()`` cannot run the close any more; its client's sockets
are then left to the garbage collector, as httpx leaves them.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator, Callable

import httpx


async def _guard(client: httpx.AsyncClient, loop: asyncio.AbstractEventLoop,
                 entries: weakref.ref[weakref.WeakKeyDictionary]) -> AsyncIterator[None]:
    """Suspended at its ``yield`` for the client's life; closing it closes the client."""
    try:
        yield
    finally:
        table = entries()  # a weak reference: the guard must not keep its owner alive
        if table is not None and table.get(loop, (None,))[0] is client:
            del table[loop]
        await client.aclose()


def _start(guard: AsyncIterator[None]) -> None:
    """Run the guard to its ``yield`` now, on the running loop (which registers it for shutdown)."""
    step = guard.asend(None)  # the loop's first-iteration hook runs here
    try:
        step.send(None)
    except StopIteration:
        return
    raise RuntimeError("the client guard did not stop at its yield")  # pragma: no cover - a bug


class LoopClients:
    """The client of the running loop, made by ``make()`` on first use in each loop."""

    def __init__(self, make: Callable[[], httpx.AsyncClient]):
        self._make = make
        # loop -> (client, guard); an entry leaves when its guard closes (loop shutdown or aclose)
        self._by_loop: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def current(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        entry = self._by_loop.get(loop)
        if entry is not None and not entry[0].is_closed:
            return entry[0]
        for old in [k for k in self._by_loop if k.is_closed()]:  # closed without shutdown: nothing to run there
            del self._by_loop[old]
        client = self._make()
        guard = _guard(client, loop, weakref.ref(self._by_loop))
        self._by_loop[loop] = (client, guard)
        _start(guard)
        return client

    async def aclose(self) -> None:
        """Close the running loop's client (those of other loops close with their loops)."""
        entry = self._by_loop.pop(asyncio.get_running_loop(), None)
        if entry is not None:
            await entry[1].aclose()

    def __len__(self) -> int:
        return len(self._by_loop)
