"""The step drivers shared by the sync and async forms of the LangGraph nodes, hooks and tools, and the
SpawnPacer's claim watcher (sync thread and async task) run by them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from opencoti.langgraph import SpawnPacer
from opencoti.langgraph._clients import ClientPair
from opencoti.langgraph.steps import adrive, call, drive


def _steps(log: list):
    total = yield ("add", 1, 2)
    try:
        yield ("fail", "no pool")
    except LookupError as e:  # the step's exception is raised at its yield
        log.append(str(e))
    total += yield ("add", total, 10)
    return total, log


def _fail(msg):
    raise LookupError(msg)


def test_drive_and_adrive_run_the_same_steps():
    assert drive(_steps([]), {"add": lambda a, b: a + b, "fail": _fail}) == (16, ["no pool"])

    async def add(a, b):
        await asyncio.sleep(0)
        return a + b
    # adrive awaits what is awaitable and takes a plain value as it is
    assert asyncio.run(adrive(_steps([]), {"add": add, "fail": _fail})) == (16, ["no pool"])
    assert asyncio.run(adrive(_steps([]), {"add": lambda a, b: a + b, "fail": _fail})) == (16, ["no pool"])


def test_an_exception_the_steps_do_not_handle_reaches_the_caller():
    def steps():
        yield ("fail", "gone")
        return "unreachable"
    with pytest.raises(LookupError, match="gone"):
        drive(steps(), {"fail": _fail})
    with pytest.raises(LookupError, match="gone"):
        asyncio.run(adrive(steps(), {"fail": _fail}))


def test_call_step():
    assert call("a,b", "split", (",",)) == ["a", "b"]
    assert call(" x ", "strip") == "x"


class _Server:
    """Capacity reports that know the session from the ``known_after``-th call on; ``fail``: every call raises."""

    def __init__(self, known_after: int, fail: bool = False):
        self.calls, self.known_after, self.fail = 0, known_after, fail

    def capacity(self, pool_id, session_id=None):
        self.calls += 1
        if self.fail:
            raise LookupError("pool 3 not found")
        return SimpleNamespace(known_session=self.calls >= self.known_after)

    def events(self, pool_id, since=None):
        return []


class _AsyncServer(_Server):
    async def capacity(self, pool_id, session_id=None):
        return _Server.capacity(self, pool_id, session_id)

    async def events(self, pool_id, since=None):
        return []


def _held(pacer: SpawnPacer, pool_id: int) -> bool:
    lock = pacer._lock(pool_id)
    if lock.acquire(timeout=0):
        lock.release()
        return False
    return True


@pytest.mark.parametrize("fail", [False, True])
def test_claim_counts_the_session_unseen_until_it_is_known(fail):
    """A claim does not hold the pool's turn (the gates of a batch spawn at once); the session counts
    as unseen, which a gate deciding on a report of its own waits out, until the server knows it."""
    pacer = SpawnPacer(claim_timeout_s=5, claim_poll_s=0.01)
    server = _Server(known_after=3, fail=fail)
    pacer.claim(ClientPair(server, None), 3, "s")
    assert not _held(pacer, 3)
    assert pacer.wait_seen(3, 5.0) and pacer.unseen(3) == 0
    assert server.calls == (1 if fail else 3)  # a failing server ends the wait at once


@pytest.mark.parametrize("fail", [False, True])
def test_aclaim_counts_the_session_unseen_until_it_is_known(fail):
    pacer = SpawnPacer(claim_timeout_s=5, claim_poll_s=0.01)
    server = _AsyncServer(known_after=3, fail=fail)

    async def run():
        pacer.aclaim(ClientPair(None, server), 3, "s")
        assert pacer.unseen(3) == 1 and not _held(pacer, 3)
        await asyncio.gather(*pacer._tasks)
        return pacer.unseen(3)
    assert asyncio.run(run()) == 0
    assert server.calls == (1 if fail else 3)
