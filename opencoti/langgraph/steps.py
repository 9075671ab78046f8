"""Logic written once as a generator of steps, run by a sync or an async driver.

A step is a tuple ``(kind, *args)`` naming one piece of I/O (a client call, a sleep, a lock); the
generator receives its result at the ``yield`` (or its exception, raised there) and returns its
answer. The sync and async forms of a node, a hook or a tool then differ only in the table that
does the steps: ``drive`` calls plain functions, ``adrive`` awaits what its functions return.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Generator, Mapping

Steps = Generator[tuple, Any, Any]


def drive(steps: Steps, do: Mapping[str, Callable[..., Any]]) -> Any:
    """Run ``steps``: each ``(kind, *args)`` is done by ``do[kind](*args)``; returns what ``steps`` returns."""
    result, error = None, None
    while True:
        try:
            step = steps.send(result) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value
        try:
            result, error = do[step[0]](*step[1:]), None
        except Exception as e:  # noqa: BLE001 - raised in the generator, at its yield
            result, error = None, e


async def adrive(steps: Steps, do: Mapping[str, Callable[..., Any]]) -> Any:
    """``drive`` for async code: what a function of ``do`` returns is awaited when it is awaitable."""
    result, error = None, None
    while True:
        try:
            step = steps.send(result) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value
        try:
            result, error = do[step[0]](*step[1:]), None
            if inspect.isawaitable(result):
                result = await result
        except Exception as e:  # noqa: BLE001 - raised in the generator, at its yield
            result, error = None, e


def call(client: Any, method: str, args: tuple = (), kwargs: Mapping[str, Any] | None = None) -> Any:
    """The step ``("call", method, args, kwargs)`` on a PolyKV client (sync, or async: a coroutine)."""
    return getattr(client, method)(*args, **(kwargs or {}))
