"""Request batching: requests arriving together are decoded in one batch.

Handlers put a ``Job`` (its sentences, decoding options and a future) on an asyncio queue; one
worker task takes the first job, then every job already waiting and every job that arrives less
than ``max_wait_ms`` after the one before (for at most ``max_gather_ms`` in all), until
``max_batch_tokens`` source tokens are gathered. Waiting for a stream of arrivals to pause, not a
fixed time, keeps the clients answered by one batch together in the next: their new requests
come back within milliseconds of each other, while the decoder is idle. It groups the jobs by identical
options, decodes each group with one call in a single decoding thread or process (``executor``),
and hands every job its own slice of the results, in its own order. A job whose client went
away before its batch began is dropped, and one that waited longer than ``max_queue_s`` is
answered with ``QueueTimeout`` instead of being decoded. Beam search of a sentence in a padded batch gives the
tokens it gives alone, so batching across requests changes no output.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable
from concurrent.futures import BrokenExecutor, Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class Job:
    texts: list[str]
    options: Hashable  # jobs with equal options share a decoding call
    tokens: int  # source tokens, for the batch budget
    future: asyncio.Future = field(repr=False)
    queued: float = field(default_factory=time.monotonic)


class QueueFull(Exception):
    """More requests are waiting than ``max_queue``."""


class ClientGone(Exception):
    """The client disconnected while its request waited: the request was cancelled."""


class QueueTimeout(Exception):
    """A request waited longer than ``max_queue_s`` before its batch began: it is not decoded."""

    def __init__(self, waited: float, limit: float) -> None:
        super().__init__(f"waited {waited:.1f} s for the decoder")
        self.waited, self.limit = waited, limit


class Batcher:
    """Gathers jobs into batches and decodes them with ``decode(texts, options) -> results``
    (one result per text, in order), one batch at a time, in ``executor`` (default: one thread;
    a one-process pool keeps decoding from competing with the event loop for the GIL)."""

    def __init__(self, decode: Callable[[list[str], Any], list[Any]], max_wait_ms: float = 5.0,
                 max_batch_tokens: int = 8192, max_queue: int = 1024, executor: Executor | None = None,
                 max_gather_ms: float = 50.0, max_queue_s: float | None = None,
                 restart: Callable[[], Executor] | None = None) -> None:
        self.decode = decode
        self.restart = restart  # a new executor for one whose process died (a decoding process killed)
        self.max_wait = float(max_wait_ms) / 1000
        self.max_gather = float(max_gather_ms) / 1000
        self.max_batch_tokens = int(max_batch_tokens)
        self.max_queue = int(max_queue)
        self.max_queue_s = None if max_queue_s is None else float(max_queue_s)
        self.queue: asyncio.Queue[Job] | None = None
        self.task: asyncio.Task | None = None
        self.executor = executor or ThreadPoolExecutor(1, thread_name_prefix="nmt-decode")
        self.stats = {"requests": 0, "sentences": 0, "batches": 0, "decode_s": 0.0, "abandoned": 0, "timed_out": 0,
                      "restarts": 0}

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the decoding executor (start-up work: load the model there)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def _decode(self, texts: list[str], options: Any) -> list[Any]:
        """``decode(texts, options)`` in the executor; where its process died (killed, out of memory),
        a new one from ``restart`` decodes them again, once."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.executor, self.decode, texts, options)
        except BrokenExecutor as e:
            if self.restart is None:
                raise
            log.warning("the decoding process stopped (%s); a new one decodes the batch again", type(e).__name__)
            self.executor.shutdown(wait=False, cancel_futures=True)
            self.executor = self.restart()
            self.stats["restarts"] += 1
            return await loop.run_in_executor(self.executor, self.decode, texts, options)

    def start(self) -> None:
        """Start the worker in the running event loop (once; handlers call it on first use)."""
        loop = asyncio.get_running_loop()
        if self.task is not None and not self.task.done() and self.task.get_loop() is not loop:
            raise RuntimeError("the batcher's worker runs in another event loop")
        if self.task is None or self.task.done():
            self.queue = asyncio.Queue()
            self.task = loop.create_task(self._run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None
        self.executor.shutdown(wait=True, cancel_futures=True)  # a decoding process ends with the server

    def pending(self) -> int:
        return self.queue.qsize() if self.queue is not None else 0

    async def submit(self, texts: list[str], options: Hashable, tokens: int,
                     gone: Callable[[], Awaitable[bool]] | None = None, poll_s: float = 0.1) -> list[Any]:
        """The results of ``texts``, decoded in a batch with whatever else is waiting. ``gone``
        (the client disconnected) is asked every ``poll_s`` while the request waits: a request
        whose client left is cancelled, and not decoded unless its batch has begun."""
        self.start()
        if self.queue.qsize() >= self.max_queue:
            raise QueueFull(self.max_queue)
        job = Job(texts, options, tokens, asyncio.get_running_loop().create_future())
        self.queue.put_nowait(job)
        while gone is not None and not job.future.done():
            await asyncio.wait([job.future], timeout=poll_s)
            if not job.future.done() and await gone():
                job.future.cancel()
                raise ClientGone()
        return await job.future

    async def _gather(self, first: Job) -> list[Job]:
        """``first`` and the jobs waiting or arriving less than ``max_wait_ms`` apart (at most
        ``max_gather_ms``), up to ``max_batch_tokens``."""
        jobs, tokens = [first], first.tokens
        end = time.monotonic() + self.max_gather
        while tokens < self.max_batch_tokens:
            try:
                job = self.queue.get_nowait()
            except asyncio.QueueEmpty:
                left = min(self.max_wait, end - time.monotonic())
                if left <= 0:
                    break
                try:
                    job = await asyncio.wait_for(self.queue.get(), left)
                except asyncio.TimeoutError:
                    break
            if tokens + job.tokens > self.max_batch_tokens:
                self._carry = job  # the first of the next batch
                break
            jobs.append(job)
            tokens += job.tokens
        return jobs

    async def _run(self) -> None:
        self._carry: Job | None = None
        while True:
            first, self._carry = (self._carry, None) if self._carry is not None else (await self.queue.get(), None)
            jobs = await self._gather(first)
            groups: dict[Hashable, list[Job]] = {}
            now = time.monotonic()
            for job in jobs:
                if job.future.cancelled():  # a client that went away: its sentences are not decoded
                    self.stats["abandoned"] += 1
                elif self.max_queue_s is not None and now - job.queued > self.max_queue_s:
                    self.stats["timed_out"] += 1
                    job.future.set_exception(QueueTimeout(now - job.queued, self.max_queue_s))
                else:
                    groups.setdefault(job.options, []).append(job)
            for options, group in groups.items():
                texts = [text for job in group for text in job.texts]
                start = time.perf_counter()
                try:
                    results = await self._decode(texts, options)
                except Exception as e:  # noqa: BLE001  the worker lives on
                    if len(group) > 1:  # one bad request fails no other: each is decoded again on its own
                        log.warning("decoding a batch of %d requests failed (%s); decoding them one by one",
                                    len(group), type(e).__name__)
                        for job in group:
                            await self._decode_alone(job, options)
                        continue
                    log.exception("decoding a request of %d sentences failed", len(texts))
                    if not group[0].future.done():
                        group[0].future.set_exception(e)
                    continue
                self.stats["batches"] += 1
                self.stats["requests"] += len(group)
                self.stats["sentences"] += len(texts)
                self.stats["decode_s"] += time.perf_counter() - start
                offset = 0
                for job in group:
                    if not job.future.done():
                        job.future.set_result(results[offset: offset + len(job.texts)])
                    offset += len(job.texts)

    async def _decode_alone(self, job: Job, options: Hashable) -> None:
        """``job`` decoded in a call of its own: its results, or the error that is its own."""
        if job.future.done():
            return
        try:
            results = await self._decode(job.texts, options)
        except Exception as e:  # noqa: BLE001
            log.exception("decoding a request of %d sentences failed", len(job.texts))
            if not job.future.done():
                job.future.set_exception(e)
            return
        self.stats["batches"] += 1
        self.stats["requests"] += 1
        self.stats["sentences"] += len(job.texts)
        if not job.future.done():
            job.future.set_result(results)
