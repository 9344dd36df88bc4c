"""The OpenAI request bodies the server accepts, and its OpenAI-style errors.

Fields follow OpenAI's ``/v1/completions`` and ``/v1/chat/completions``. Values of the wrong type
or outside their range fail schema validation (HTTP 422); requests that are well-formed but cannot
be served (unknown model, empty prompt, prompt longer than the context, a feature this server does
not have) fail with 400/404. Unknown fields are ignored, as OpenAI's clients add new ones over time;
known fields this server cannot honour (``logprobs``, ``echo``, ``best_of`` > 1, tools, penalties)
are refused rather than silently dropped.

HiSpec's own per-request options travel in the ``hispec`` extension object (with the OpenAI
client: ``extra_body={"hispec": {...}}``); ``return_token_ids`` (as vLLM names it) adds the prompt
and output token ids to each choice.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt


class ServerError(Exception):
    """An error the client caused or must know about, sent as OpenAI's error object."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
             503: "server_overloaded"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


class HiSpecOptions(BaseModel):
    """The ``hispec`` extension: per-request options beyond OpenAI's fields."""

    model_config = ConfigDict(extra="forbid")

    top_k: StrictInt = Field(0, ge=0, description="sample among the k most likely tokens (0: all)")
    ignore_eos: bool = Field(False, description="keep generating after the end-of-sequence token")
    return_stats: bool = Field(False, description="add per-choice speculation statistics (acceptance, passes)")
    drafter_invariant: bool = Field(False, description="Gumbel-max sampling keyed to (seed, position): a seeded "
                                    "sample is the same text for any method, policy and batch")
    # fixed per server: accepted when they equal the server's, refused otherwise
    method: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: StrictInt = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI fields this server does not implement: refused unless left at their neutral value
    logprobs: Any = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # extensions
    hispec: HiSpecOptions = Field(default_factory=HiSpecOptions)
    return_token_ids: bool = False

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise ServerError(400, "stop holds at most 4 strings", "stop")
        if any(not s for s in stops):
            raise ServerError(400, "stop strings must not be empty", "stop")
        return stops

    def check_supported(self) -> None:
        if self.logprobs not in (None, False, 0):
            raise ServerError(400, "logprobs are not supported by this server", "logprobs")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0):
                raise ServerError(400, f"{name} is not supported: it would change the base model's distribution", name)
        if self.logit_bias:
            raise ServerError(400, "logit_bias is not supported by this server", "logit_bias")


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    max_tokens: StrictInt | None = Field(16, ge=1)  # OpenAI's default for completions

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise ServerError(400, "echo is not supported by this server", "echo")
        if self.best_of not in (None, 1):
            raise ServerError(400, "best_of is not supported by this server (use n)", "best_of")
        if self.suffix:
            raise ServerError(400, "suffix is not supported by this server", "suffix")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text; content parts other than text are refused."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ServerError(400, f"content parts of type {part.get('type')!r} are not supported; send text",
                                  "messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    tools: list[Any] | None = None
    top_logprobs: int | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise ServerError(400, "tools are not supported by this server", "tools")
        if self.top_logprobs:
            raise ServerError(400, "logprobs are not supported by this server", "top_logprobs")
