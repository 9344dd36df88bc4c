"""``AsyncEngine``: one thread steps the :class:`LLMEngine`; asyncio handlers add, read and abort requests.

The engine is not thread-safe, so only its thread touches it (a thread of its own, or the main
thread in ``hispec-serve``, see :meth:`AsyncEngine.run`). Handlers send it commands through a
queue (add a request, abort one, stop); between two steps it applies them all, then serves one
sweep and posts each request's committed tokens to that request's ``asyncio.Queue`` on the event
loop. An idle engine blocks on the command queue and costs nothing.

Requests are bounded: beyond ``max_queue`` requests waiting for a place in the running batch,
:meth:`add` refuses new ones (HTTP 503) instead of queueing without limit. A finished or aborted
request is released from the engine at once (its KV blocks are freed in the abort itself).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..engine.llm_engine import LLMEngine
from ..engine.sequence import Counters
from ..errors import HiSpecError
from ..outputs import level_names
from ..sampling_params import SamplingParams
from .protocol import ServerError

logger = logging.getLogger(__name__)

RATE_WINDOW_S = 10.0  # tokens/s is measured over this trailing window
PUBLISH_EVERY_S = 0.05  # the metrics snapshot is refreshed this often while requests run
DRAIN_POLL_S = 0.02  # how often a drain checks whether the requests in flight have ended
DRAIN_GRACE_S = 5.0  # after the engine stops, how long a drain waits for handlers to send their 503s


@dataclass
class Event:
    """Committed tokens of one request; the last event has ``finished`` (or ``error``) set."""

    request_id: int
    tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS), "length", "abort"
    counters: Counters | None = None  # the request's speculation counters, on the last event
    error: str | None = None


@dataclass
class Snapshot:
    """The engine's state for ``/metrics``, replaced (never mutated) by the engine thread."""

    running: int = 0
    waiting: int = 0
    blocks_used: int = 0
    blocks_free: int = 0
    preemptions: int = 0
    aborted: int = 0  # requests stopped before they finished (client gone, shutdown)
    generated_tokens: int = 0
    tokens_per_second: float = 0.0
    counters: Counters = field(default_factory=Counters)  # finished requests and the running ones so far
    levels: tuple[str, ...] = ()  # the name of each level of ``counters`` (outputs.level_names), drafter first


@dataclass
class RequestHandle:
    request_id: int
    events: asyncio.Queue  # of Event


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue: int = 256, threaded: bool = True) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.threaded = threaded  # False: the caller runs :meth:`run` (the CLI, on the main thread)
        self.levels = tuple(level_names(engine.exits, engine.runner.decoder.num_layers))
        self.snapshot = Snapshot(blocks_free=engine.cache.manager.num_blocks, levels=self.levels)
        self.in_flight = 0  # requests added and not yet finished (event-loop side)
        self.accepting = True
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, asyncio.Queue] = {}  # engine thread only
        self._finished_counters = Counters()  # engine thread only
        self._generated = 0
        self._aborted = 0
        self._published = 0.0
        self._rate: collections.deque[tuple[float, int]] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()  # set once the event loop is known
        self._thread = threading.Thread(target=self.run, name="hispec-engine", daemon=True)

    # -- event-loop side ---------------------------------------------------------------------
    def start(self) -> None:
        """Called on the event loop at start-up; starts the engine thread unless the caller runs it."""
        self._loop = asyncio.get_running_loop()
        self._ready.set()
        if self.threaded:
            self._thread.start()

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    def check_room(self, choices: int) -> None:
        """Refuse (503) a request whose ``choices`` would not all find a place in the queue now (an empty
        queue takes any request), before any of them is added."""
        if not self.accepting:
            raise ServerError(503, "the server is shutting down", code="shutting_down")
        waiting = self.in_flight - self.snapshot.running
        if waiting and waiting + choices > self.max_queue:
            raise ServerError(503, f"the server is overloaded ({waiting} requests wait, {self.max_queue} may); retry "
                                   f"later", code="queue_full")

    async def add(self, prompt: list[int], sampling_params: SamplingParams,
                  events: asyncio.Queue | None = None) -> RequestHandle:
        """Queue a request whose events go to ``events`` (several requests may share one queue:
        events carry their request id); fails with :class:`ServerError` (400 bad request, 503 full
        or stopping)."""
        if not self.accepting:
            raise ServerError(503, "the server is shutting down", code="shutting_down")
        if self.in_flight - self.snapshot.running >= self.max_queue:
            raise ServerError(503, f"the server is overloaded ({self.max_queue} requests already wait); retry later",
                              code="queue_full")
        future = self._loop.create_future()
        events = events if events is not None else asyncio.Queue()
        self.in_flight += 1
        self._commands.put(("add", (prompt, sampling_params, events, future)))
        try:
            request_id = await future
        except BaseException:
            self.in_flight -= 1
            if future.done() and not future.cancelled() and future.exception() is None:
                self._commands.put(("abort", future.result()))  # added, but its handler was cancelled meanwhile
            raise
        return RequestHandle(request_id, events)

    def done(self, handle: RequestHandle, abort: bool, finished: bool = False) -> None:
        """The handler is finished with a request: abort it in the engine if it still runs (``finished``:
        its answer is complete, e.g. at a stop string, so it does not count as aborted)."""
        self.in_flight -= 1
        if abort:
            self._commands.put(("end" if finished else "abort", handle.request_id))

    def request_stop(self) -> None:
        """Stop the engine loop after the commands already queued (thread-safe; e.g. the HTTP
        server exited without its lifespan shutdown)."""
        self.accepting = False
        self._commands.put(("stop", None))

    async def drain(self, timeout: float, grace: float = DRAIN_GRACE_S) -> None:
        """Stop admitting (new requests get 503), give the requests in flight ``timeout`` seconds to
        finish, then stop the engine: what still runs ends with the 503 error (a final error event for
        a stream). Returns once every handler has handed its requests back, or ``grace`` seconds later."""
        self.accepting = False
        await self._until_idle(timeout)
        self.request_stop()  # the engine aborts what still runs; each handler answers 503
        await self._until_idle(grace)

    async def _until_idle(self, timeout: float) -> None:
        """Wait until no request is in flight, at most ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)

    def drain_threadsafe(self, timeout: float) -> concurrent.futures.Future:
        """:meth:`drain` from another thread (a signal handler); the future is done when it is."""
        return asyncio.run_coroutine_threadsafe(self.drain(timeout), self._loop)

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stop accepting, abort what still runs, stop the thread (joined within ``timeout``)."""
        self.accepting = False
        self._commands.put(("stop", None))
        if self.threaded:
            await asyncio.to_thread(self._thread.join, timeout)

    # -- engine thread -----------------------------------------------------------------------
    def _call(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` on the event loop (from the engine thread)."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop has closed (the server is exiting)
            pass

    def _post(self, events: asyncio.Queue, event: Event) -> None:
        self._call(events.put_nowait, event)

    def run(self) -> None:
        """The engine loop, until :meth:`shutdown`. Torch runs fastest on the process's main thread
        (libgomp throttles its workers' spinning once a second thread has its own OpenMP pool:
        measured 0.6x), so ``hispec-serve`` runs this there and the HTTP event loop on a thread."""
        self._ready.wait()
        while True:
            commands = []
            if not self.engine.has_unfinished():  # idle: wait for work (waking now and then to refresh the rate)
                try:
                    commands.append(self._commands.get(timeout=1.0))
                except queue.Empty:
                    pass
            while True:  # and every command that arrived during the last step
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for command in commands:
                if not self._apply(command):
                    return self._stop()
            if self.engine.has_unfinished():
                self._step()
            self._publish()

    def _apply(self, command: tuple[str, Any]) -> bool:
        """Apply one command; False for "stop"."""
        kind, arg = command
        if kind == "stop":
            return False
        if kind == "add":
            prompt, sampling_params, events, future = arg
            try:
                request_id = self.engine.add_request(prompt, sampling_params)
            except HiSpecError as exc:
                self._call(_fail, future, ServerError(400, str(exc)))
                return True
            self._streams[request_id] = events
            self._call(self._resolve, future, request_id)
        elif kind in ("abort", "end") and arg in self._streams:
            self._abort(arg, counted=kind == "abort")
        return True

    def _resolve(self, future: asyncio.Future, request_id: int) -> None:
        if future.cancelled():  # the client left before its request was added
            self._commands.put(("abort", request_id))
        else:
            future.set_result(request_id)

    def _abort(self, request_id: int, counted: bool = True) -> None:
        """Stop a request in the engine; ``counted``: it did not finish (a choice ended by a stop string
        did: its request only runs on until this lands)."""
        self.engine.abort(request_id)
        self._release(request_id)
        self._aborted += counted

    def _release(self, request_id: int) -> Counters:
        seq = self.engine.release(request_id)
        del self._streams[request_id]
        self._finished_counters.add(seq.counters)
        return seq.counters

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a bug or an impossible request: fail the running ones, keep serving
            logger.exception("engine step failed; aborting the running requests")
            for request_id, events in list(self._streams.items()):
                seq = self.engine.sequences[request_id]
                if seq.status.value == "running":
                    self._abort(request_id)
                    self._post(events, Event(request_id, [], True, "abort", error=f"engine error: {exc}"))
            return
        posts = []
        for out in outputs:
            self._generated += len(out.new_tokens)
            events = self._streams[out.request_id]
            if out.finished:
                reason = self.engine.sequences[out.request_id].finish_reason
                posts.append((events, Event(out.request_id, out.new_tokens, True, reason, self._release(out.request_id))))
            else:
                posts.append((events, Event(out.request_id, out.new_tokens)))
        if any(out.finished for out in outputs):
            self._publish(force=True)  # a client that has its whole answer finds it counted in /metrics
        for events, event in posts:
            self._post(events, event)

    def _publish(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._published < PUBLISH_EVERY_S and self.engine.has_unfinished():
            return  # a snapshot per step would cost the engine loop time; idle states are always published
        self._published = now
        self._rate.append((now, self._generated))
        while len(self._rate) > 2 and now - self._rate[1][0] >= RATE_WINDOW_S:
            self._rate.popleft()
        (t0, n0) = self._rate[0]
        counters = Counters()
        counters.add(self._finished_counters)
        for request_id in self._streams:  # running, waiting and preempted requests alike
            counters.add(self.engine.sequences[request_id].counters)
        manager = self.engine.cache.manager
        self.snapshot = Snapshot(
            running=len(self.engine.scheduler.running), waiting=len(self.engine.scheduler.waiting),
            blocks_used=manager.num_blocks - manager.num_free, blocks_free=manager.num_free,
            preemptions=self.engine.preemptions, aborted=self._aborted, generated_tokens=self._generated,
            tokens_per_second=(self._generated - n0) / (now - t0) if now > t0 else 0.0, counters=counters,
            levels=self.levels)

    def _stop(self) -> None:
        """Abort whatever is still running (its handlers get a final "abort" event)."""
        for request_id, events in list(self._streams.items()):
            self._abort(request_id)
            self._post(events, Event(request_id, [], True, "abort", error="the server shut down"))
        self._publish(force=True)


def _fail(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
