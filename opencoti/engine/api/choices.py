"""``n`` choices of one prompt (OpenAI ``n``), the prompt computed once.

The prompt (all but its last token, whose logits each choice needs) is materialized once as a
temporary pool; the n choices are sessions attached to it, so each computes only the last prompt
token and then decodes on its own, batched with the others. When the request names a pool, the
choices attach to that pool instead. Choice i samples with ``seed + i`` when a seed is given (so
seeded choices differ from each other and are reproducible). At the end the choices' sessions and
the temporary pool are released.

If the pool budget is exhausted the choices run without the shared prefix (same results, the
prompt computed n times); every other error is raised.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, AsyncIterator

from ..config import SamplingParams
from ..errors import CapacityError, InvalidRequestError

__all__ = ["MAX_CHOICES", "choice_params", "Choices", "merge_streams"]

MAX_CHOICES = 16
_MASK64 = (1 << 64) - 1


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """Per-choice parameters: choice i uses ``seed + i`` (unseeded choices draw fresh seeds)."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise InvalidRequestError(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}")
    if params.seed is None:
        return [params] * n
    out = []
    for i in range(n):
        seed = (params.seed + i) & _MASK64
        if seed >= 2**63 and params.seed < 0:
            seed -= 2**64
        out.append(dataclasses.replace(params, seed=seed))
    return out


class Choices:
    """Run n choices: ``await start()``, then iterate ``(index, TokenDelta)`` events as they come;
    ``results[i]`` / ``streams[i].info`` afterwards; always ``await aclose()`` (releases the
    temporary pool and the choices' sessions, cancels what is still running)."""

    def __init__(self, engine, tokens: list[int], params: SamplingParams, n: int, *, pool_id: int | None = None,
                 session_id: str | None = None, **kwargs: Any):
        if n > 1 and session_id is not None:
            raise InvalidRequestError("n > 1 cannot be combined with session_id (each choice is its own session)")
        if n > 1 and kwargs.get("shared_prefix_n_tokens") is not None:
            raise InvalidRequestError("n > 1 cannot be combined with shared_prefix_n_tokens")
        self.engine, self.tokens, self.n = engine, tokens, n
        self.params = choice_params(params, n)
        self.pool_id, self.session_id, self.kwargs = pool_id, session_id, kwargs
        self.temp_pool: int | None = None
        self.streams: list = []
        self.results: list = [None] * n

    async def start(self) -> None:
        pool_id = self.pool_id
        if self.n > 1 and pool_id is None and len(self.tokens) > 1:
            try:
                info = await asyncio.to_thread(self.engine.create_pool, tokens=self.tokens[:-1], label="n-choices")
                self.temp_pool = pool_id = info.pool_id
            except CapacityError:
                pool_id = None  # no pool slot left: the choices compute the prompt themselves
        try:
            for p in self.params:
                self.streams.append(await self.engine.astream(
                    self.tokens, params=p, pool_id=pool_id, session_id=self.session_id, **self.kwargs))
        except BaseException:
            await self.aclose()
            raise

    @property
    def info(self):
        """The first choice's RequestInfo (what the response headers describe)."""
        return self.streams[0].info

    async def events(self, ends: bool = False) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, TokenDelta) in arrival order; ``results`` is filled as choices end.
        ``ends``: also yield (index, None) when a choice ends (its result is then in ``results``)."""
        async for i, d in merge_streams(self.streams):
            if d is None:
                self.results[i] = self.streams[i].result
                if not ends:
                    continue
            yield i, d

    async def collect(self) -> list:
        async for _ in self.events():
            pass
        return self.results

    async def aclose(self) -> None:
        for s in self.streams:
            if s.result is None:
                await s.aclose()
        if self.n > 1:
            for s in self.streams:
                await asyncio.to_thread(quietly, self.engine.release_session, s.info.session_id)
        if self.temp_pool is not None:
            pool, self.temp_pool = self.temp_pool, None
            await asyncio.to_thread(quietly, self.engine.release_pool, pool, immediate=True)


async def merge_streams(streams: list) -> AsyncIterator[tuple[int, Any]]:
    """(stream index, TokenDelta) from several engine streams in arrival order, and (index, None)
    when stream ``index`` has ended (its ``result`` is set). The first error of any stream is
    raised; the streams themselves are left to the caller to close."""
    if len(streams) == 1:
        async for d in streams[0]:
            yield 0, d
        yield 0, None
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream) -> None:
        try:
            async for d in stream:
                await queue.put((i, d, None))
            await queue.put((i, None, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, None, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, d, err = await queue.get()
            if err is not None:
                raise err
            if d is None:
                left -= 1
            yield i, d
    finally:
        for t in tasks:
            t.cancel()


def quietly(fn, *args, **kw) -> None:
    """Best-effort cleanup: ``fn(*args, **kw)``, its error ignored (the session or pool may be gone)."""
    try:
        fn(*args, **kw)
    except Exception:  # noqa: BLE001 - best-effort cleanup (already gone)
        pass
