"""One completion request end to end: submit its choices, follow their tokens, answer in OpenAI's shape.

A request becomes ``len(prompts) * n`` engine requests ("choices"; choice ``i`` of a prompt samples
with ``seed + i``). Each choice's committed tokens become text through a
:class:`~hispec_decode.serving.detokenize.TextStream`; a stop string ends the choice there (its
engine request is aborted, so its blocks are freed at once). Non-streamed requests answer one JSON
object; streamed ones send server-sent events (``data: {chunk}``, then ``data: [DONE]``). No chunk
precedes a choice's first text: a chat choice's role comes with it (or with its finishing chunk, if
it ends without text), so a client timing the first chunk (``vllm bench serve``) measures the real
time to the first token. A client that goes away has every unfinished choice aborted.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.responses import StreamingResponse

from ..sampling_params import SamplingParams
from .async_engine import AsyncEngine, Event, RequestHandle
from .detokenize import TextStream
from .metrics import ServerMetrics
from .protocol import ServerError

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


@dataclass
class Job:
    """What the handler decided: the prompts, the engine fields of each choice, how to answer."""

    chat: bool
    model: str
    prompts: list[list[int]]
    n: int
    sampling: SamplingParams  # of every choice (seed: of choice 0)
    stop: list[str]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    return_stats: bool
    arrival: float = field(default_factory=time.perf_counter)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class Choice:
    index: int
    prompt: list[int]
    handle: RequestHandle
    text: TextStream
    finish_reason: str | None = None
    counters: Any = None
    sent_ids: int = 0  # output token ids already streamed (with return_token_ids)
    started: bool = False  # a chunk of it has been streamed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def accept(self, event: Event) -> str:
        """Apply one engine event; returns the text it adds."""
        if event.error is not None:
            raise ServerError(503, event.error, code="aborted")
        delta = self.text.add(event.tokens)
        if self.text.stopped:
            self.finish_reason = "stop"
        elif event.finished:
            self.finish_reason, self.counters = event.finish_reason, event.counters
            delta += self.text.finish()
            if self.text.stopped:  # a stop string completed by the held-back tail
                self.finish_reason = "stop"
        return delta

    def take_ids(self) -> list[int]:
        """Output token ids not streamed yet (up to a stop string's end)."""
        ids = self.text.ids[self.sent_ids : self.text.num_tokens]
        self.sent_ids = self.text.num_tokens
        return ids


class CompletionRun:
    def __init__(self, engine: AsyncEngine, tokenizer: Any, metrics: ServerMetrics, job: Job) -> None:
        self.engine, self.tokenizer, self.metrics, self.job = engine, tokenizer, metrics, job
        self.choices: list[Choice] = []
        self.events: asyncio.Queue = asyncio.Queue()  # every choice's engine events, in arrival order
        self.by_request: dict[int, Choice] = {}
        self.first_text = False
        self.released = False

    async def submit(self) -> None:
        job = self.job
        seed = job.sampling.seed
        self.engine.check_room(len(job.prompts) * job.n)  # all of its choices, or none
        try:
            for p, prompt in enumerate(job.prompts):
                for i in range(job.n):
                    params = job.sampling if seed is None else job.sampling.replace(seed=(seed + i) % 2**63)
                    handle = await self.engine.add(prompt, params, self.events)
                    self.choices.append(Choice(p * job.n + i, prompt, handle, TextStream(self.tokenizer, job.stop)))
                    self.by_request[handle.request_id] = self.choices[-1]
        except BaseException:
            self.close()
            raise
        self.metrics.prompt_tokens.inc(sum(len(p) for p in job.prompts))

    def close(self) -> None:
        """Hand every choice back to the engine, aborting those still running."""
        for choice in self.choices:
            self.engine.done(choice.handle, abort=not choice.finished or choice.text.stopped, finished=choice.finished)
        self.choices = []

    def _unfinished(self) -> int:
        return sum(not c.finished for c in self.choices)

    async def _next(self) -> tuple[Choice, str]:
        """The next engine event of an unfinished choice, applied: (the choice, the text it adds)."""
        while True:
            event = await self.events.get()
            choice = self.by_request[event.request_id]
            if choice.finished:  # a choice ended by a stop string: its request runs until the abort lands
                continue
            delta = choice.accept(event)
            if delta and not self.first_text:
                self.first_text = True
                self.metrics.ttft.observe(time.perf_counter() - self.job.arrival)
            return choice, delta

    # -- non-streamed ------------------------------------------------------------------------
    async def answer(self, is_disconnected) -> dict[str, Any] | None:
        """The whole response, or None if the client went away first (its choices are aborted)."""
        loop = asyncio.get_running_loop()
        checked = loop.time()
        try:
            while self._unfinished():
                try:
                    await asyncio.wait_for(self._next(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    pass
                if loop.time() - checked >= DISCONNECT_POLL_S:  # also while tokens flow
                    checked = loop.time()
                    if await is_disconnected():
                        return None
            return self._response()
        finally:
            self._finish()

    def _response(self) -> dict[str, Any]:
        job = self.job
        choices = []
        for c in self.choices:
            item: dict[str, Any] = {"index": c.index, "logprobs": None, "finish_reason": c.finish_reason}
            if job.chat:
                item["message"] = {"role": "assistant", "content": c.text.text}
            else:
                item["text"] = c.text.text
            choices.append(item | self._extras(c))
        return {"id": self._id(), "object": "chat.completion" if job.chat else "text_completion",
                "created": job.created, "model": job.model, "choices": choices, "usage": self._usage()}

    # -- streamed ----------------------------------------------------------------------------
    async def stream(self) -> AsyncIterator[str]:
        """Server-sent events; aborts the unfinished choices if the client goes away (cancellation)."""
        try:
            while self._unfinished():
                try:
                    choice, delta = await self._next()
                except ServerError as exc:  # the engine failed or shut down: end the stream with the error
                    yield _sse(exc.body())
                    break
                ids = choice.take_ids() if self.job.return_token_ids else []
                if delta or ids:
                    yield _sse(self._chunk(choice, self._delta(choice, delta), ids))
                if choice.finished:
                    yield _sse(self._chunk(choice, self._delta(choice, None), [], final=True))
            if self.job.include_usage:
                yield _sse(self._base("chunk") | {"choices": [], "usage": self._usage()})
            yield "data: [DONE]\n\n"
        finally:
            self._finish()

    def _delta(self, c: Choice, text: str | None) -> Any:
        """A chunk's ``text`` (completions) or ``delta`` (chat) for new text (None: a finishing chunk's
        nothing); a chat choice's first chunk also carries its role."""
        first, c.started = not c.started, True
        if not self.job.chat:
            return text or ""
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None or first:
            delta["content"] = text or ""
        return delta

    def _chunk(self, c: Choice, delta: Any, ids: list[int] | None = None, final: bool = False) -> dict[str, Any]:
        """A streamed chunk; with ``return_token_ids`` its ``token_ids`` are the chunk's new tokens
        (vLLM's convention) and the final chunk of a choice also carries ``prompt_token_ids``."""
        item: dict[str, Any] = {"index": c.index, "logprobs": None, "finish_reason": c.finish_reason if final else None}
        if self.job.chat:
            item["delta"] = delta
        else:
            item["text"] = delta
        if final:
            item |= self._extras(c)
        if self.job.return_token_ids:
            item["token_ids"] = ids or []
        chunk = self._base("chunk") | {"choices": [item]}
        if self.job.include_usage:
            chunk["usage"] = None
        return chunk

    # -- shared ------------------------------------------------------------------------------
    def _id(self) -> str:
        return ("chatcmpl-" if self.job.chat else "cmpl-") + self.job.id

    def _base(self, kind: str) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.job.chat else "text_completion"
        return {"id": self._id(), "object": obj, "created": self.job.created, "model": self.job.model}

    def _extras(self, c: Choice) -> dict[str, Any]:
        extras: dict[str, Any] = {}
        if self.job.return_token_ids:
            extras["prompt_token_ids"] = c.prompt
            extras["token_ids"] = c.text.ids[: c.text.num_tokens]
        if self.job.return_stats and c.counters is not None:
            k = c.counters
            extras["hispec"] = {"calls_full": k.calls_full, "calls_intermediate": k.calls_intermediate,
                                "calls_draft": k.calls_draft, "drafted": k.drafted,
                                "accepted_intermediate": k.accepted_intermediate, "tentative": k.tentative,
                                "accepted_final": k.accepted_final}
        return extras

    def _usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.job.prompts)
        completion = sum(c.text.num_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _finish(self) -> None:
        """Record the request's metrics and hand its choices back (once, however the request ended)."""
        if self.released:
            return
        self.released = True
        for c in self.choices:
            if c.finished and c.counters is not None and c.counters.calls_full:
                self.metrics.tokens_per_full_pass.observe(c.text.num_tokens / c.counters.calls_full)
        self.metrics.latency.observe(time.perf_counter() - self.job.arrival)
        self.close()


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class CompletionStream(StreamingResponse):
    """The SSE response of a run; releases the run however the response ends, also when the client
    left before the first chunk was pulled (then the body generator never starts, so its own
    ``finally`` would not run)."""

    def __init__(self, run: CompletionRun) -> None:
        super().__init__(run.stream(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.run = run

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run._finish()
