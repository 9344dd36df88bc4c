"""The OpenAI request bodies the server accepts, and its OpenAI-style errors.

Fields follow OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` (the request types of the
``openai`` client), plus the extension fields vLLM's server takes at the top level (what ``vllm
bench serve`` sends). Values of the wrong type or outside their range fail schema validation (HTTP
422); requests that are well-formed but cannot be served (unknown model, empty prompt, prompt longer
than the context, a feature this server does not have) fail with 400/404. Unknown fields are
refused (400, naming each of them) rather than silently dropped, and so are known fields this
server cannot honour (``logprobs``, ``echo``, ``best_of`` > 1, tools, penalties, JSON formats, beam
search) unless they hold their neutral value. Fields that cannot change the output tokens
(``user``, ``metadata``, ``store``, ``service_tier``, caching hints, ``prediction``) are accepted
and ignored.

vLLM's ``top_k`` (-1: all) and ``ignore_eos`` are the ``hispec`` extension's options of the same
names; ``stop_token_ids`` join the end-of-sequence ids; ``min_tokens`` > 0 is accepted only with
``ignore_eos`` and without stop strings or stop token ids (then nothing but the token limit ends a
choice, so the minimum is met trivially); ``repetition_penalty`` 1 and ``min_p`` 0 are accepted,
other values refused (they would change the base model's distribution).

HiSpec's own per-request options travel in the ``hispec`` extension object (with the OpenAI
client: ``extra_body={"hispec": {...}}``); ``return_token_ids`` (as vLLM names it) adds the prompt
and output token ids to each choice.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

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
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    include_obfuscation: bool = False  # accepted, ignored: no chunk carries padding
    continuous_usage_stats: bool = False  # vLLM's; refused when true


TokenId = Annotated[StrictInt, Field(ge=0)]
DISTRIBUTION = "it would change the base model's distribution"


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # collected, then refused by name (check_supported)

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
    # vLLM's extensions, at the top level as its server takes them
    top_k: StrictInt | None = Field(None, ge=-1, description="the hispec extension's top_k; -1 (vLLM's all) is 0")
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    min_tokens: StrictInt | None = Field(None, ge=0)
    repetition_penalty: float | None = None
    min_p: float | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    use_beam_search: bool = False
    # HiSpec's extensions
    hispec: HiSpecOptions = Field(default_factory=HiSpecOptions)
    return_token_ids: bool = False

    # fields this server cannot honour: (the values it serves, why others are refused); None is "not given"
    NEUTRAL: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = {
        "logprobs": ((None, False, 0), ""),
        "frequency_penalty": ((None, 0), DISTRIBUTION),
        "presence_penalty": ((None, 0), DISTRIBUTION),
        "repetition_penalty": ((None, 1), DISTRIBUTION),
        "min_p": ((None, 0), DISTRIBUTION),
        "logit_bias": ((None, {}), DISTRIBUTION),
        "include_stop_str_in_output": ((False,), "a stop string is never returned (OpenAI's behaviour)"),
        "skip_special_tokens": ((True,), "special tokens are always left out of the text"),
        "spaces_between_special_tokens": ((True,), ""),
        "use_beam_search": ((False,), "it would not sample the base model's distribution"),
    }

    def token_limit(self) -> int | None:
        return self.max_tokens

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise ServerError(400, "stop holds at most 4 strings", "stop")
        if any(not s for s in stops):
            raise ServerError(400, "stop strings must not be empty", "stop")
        return stops

    def check_supported(self) -> None:
        """Refuse unknown fields and what this server cannot honour; merge vLLM's top-level options
        into the ``hispec`` extension."""
        unknown = list(self.model_extra or {})
        if unknown:
            raise ServerError(400, f"unknown field(s) {', '.join(map(repr, unknown))}: this server refuses fields it "
                                   f"does not know rather than ignoring them", unknown[0])
        for name, (served, why) in self.NEUTRAL.items():
            value = getattr(self, name)
            if value not in served:
                takes = " or ".join(repr(v) for v in served if v is not None)
                raise ServerError(400, f"{name} is not supported by this server{': ' + why if why else ''} (got "
                                       f"{value!r:.80}{'; it takes ' + takes if takes else ''})", name)
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise ServerError(400, "stream_options.continuous_usage_stats is not supported by this server (usage comes "
                                   "in the last chunk)", "stream_options.continuous_usage_stats")
        self._merge("top_k", None if self.top_k is None else max(self.top_k, 0))
        self._merge("ignore_eos", self.ignore_eos)
        self._check_min_tokens()

    def _merge(self, name: str, value: Any) -> None:
        """A top-level field that the ``hispec`` extension also has: one option, given once or twice alike."""
        if value is None:
            return
        if name in self.hispec.model_fields_set and getattr(self.hispec, name) != value:
            raise ServerError(400, f"{name} is given twice with different values ({value!r} at the top level, "
                                   f"{getattr(self.hispec, name)!r} in hispec)", name)
        setattr(self.hispec, name, value)

    def _check_min_tokens(self) -> None:
        """``min_tokens`` > 0 holds only where nothing but the token limit can end a choice."""
        if not self.min_tokens:
            return
        if not self.hispec.ignore_eos:
            raise ServerError(400, "min_tokens is not supported (except with ignore_eos, where the end-of-sequence "
                                   "token cannot end a choice early)", "min_tokens")
        if self.stop or self.stop_token_ids:
            raise ServerError(400, "min_tokens cannot be combined with stop or stop_token_ids: they could end a "
                                   "choice before min_tokens", "min_tokens")
        limit = self.token_limit()
        if limit is not None and self.min_tokens > limit:
            raise ServerError(400, f"min_tokens ({self.min_tokens}) must not exceed the token limit ({limit})",
                              "min_tokens")


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    max_tokens: StrictInt | None = Field(16, ge=1)  # OpenAI's default for completions

    NEUTRAL: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = _Request.NEUTRAL | {
        "echo": ((False,), ""),
        "best_of": ((None, 1), "use n"),
        "suffix": ((None, ""), ""),
    }


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
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # ignored: there are no tools
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: Any = None
    moderation: Any = None
    # cannot change the output tokens: accepted, ignored
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prediction: Any = None  # a hint for speed; the output is the model's either way
    prompt_cache_key: str | None = None
    prompt_cache_options: Any = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None

    NEUTRAL: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = _Request.NEUTRAL | {
        "top_logprobs": ((None, 0), ""),
        "tools": ((None, []), ""),
        "tool_choice": ((None, "none", "auto"), "there are no tools"),
        "functions": ((None, []), ""),
        "function_call": ((None, "none", "auto"), "there are no functions"),
        "response_format": ((None, {"type": "text"}), "it generates free text (no JSON mode or schema)"),
        "modalities": ((None, ["text"]), "it generates text only"),
        "audio": ((None,), "it generates text only"),
        "reasoning_effort": ((None,), "it would change the prompt of a reasoning model"),
        "verbosity": ((None,), "it would change what the model is asked to write"),
        "web_search_options": ((None,), "there is no web search"),
        "moderation": ((None,), "no moderation runs on this server"),
    }

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
