"""The OpenAI-compatible HTTP API over one :class:`AsyncEngine` (FastAPI).

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (the
tokenizer's chat template), ``GET /health``, ``GET /metrics``. With an API key set, the ``/v1``
routes want ``Authorization: Bearer KEY``. Every error is OpenAI's JSON error object with its
status (400 bad request, 401 key, 404 model or route, 413 body too large, 422 schema, 503 overloaded
or shutting down); an unexpected exception is logged and answered with a 500 JSON error, never a
traceback.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from ..api import HiSpecModel
from ..engine.llm_engine import LLMEngine
from ..errors import HiSpecError
from .async_engine import AsyncEngine
from .completions import CompletionRun, CompletionStream, Job
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, ServerError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_queue: int = 256  # requests waiting for a place in the batch before new ones get 503
    max_request_choices: int = 64  # choices (prompts x n) one request may ask for; more get 400 at once
    max_body_bytes: int = 4 << 20  # larger request bodies get 413
    shutdown_timeout: float = 10.0  # seconds running requests may take to finish on SIGTERM


def build_app(model: HiSpecModel, engine: LLMEngine, config: ServerConfig, engine_thread: bool = True) -> FastAPI:
    """The app; ``app.state.engine`` is its :class:`AsyncEngine`. With ``engine_thread=False`` the
    caller runs ``app.state.engine.run()`` itself (on the main thread: see :meth:`AsyncEngine.run`)."""
    if model.tokenizer is None:
        raise HiSpecError(f"{model.base_name} has no tokenizer; the server needs one to read text prompts")
    server = AsyncEngine(engine, config.max_queue, threaded=engine_thread)
    metrics = ServerMetrics(lambda: server.snapshot, config.model_name, engine.method)
    tokenizer, context, vocab = model.tokenizer, model.decoder.max_positions, model.decoder.vocab_size
    default_eos = engine.sampling_params.eos_ids(engine.runner.decoder.default_eos_ids())  # what ends a choice unless it says

    async def lifespan(app: FastAPI):
        server.start()
        logger.info("serving %s (%s) on the %s engine", config.model_name, engine.method,
                    model.decoder.dtype)
        yield
        logger.info("shutting down: aborting %d request(s) still running", server.snapshot.running)
        await server.shutdown(config.shutdown_timeout)

    app = FastAPI(title="HiSpec", lifespan=lifespan)
    app.state.engine = server
    app.state.metrics = metrics

    @app.exception_handler(ServerError)
    async def server_error(request: Request, exc: ServerError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(ServerError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s", request.url.path)
        body = ServerError(500, f"internal error: {type(exc).__name__}").body()
        return JSONResponse(body, status_code=500)

    async def authorize(request: Request) -> None:
        if config.api_key is not None and request.headers.get("authorization", "") != f"Bearer {config.api_key}":
            raise ServerError(401, "invalid or missing API key (Authorization: Bearer KEY)", code="invalid_api_key")

    app.add_middleware(RequestCounter, metrics=metrics)
    v1 = [Depends(authorize)]

    @app.get("/health")
    async def health() -> Response:
        if not server.accepting:
            raise ServerError(503, "the server is shutting down", code="shutting_down")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=v1)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(config.model_name, context, vocab)]}

    @app.get("/v1/models/{name:path}", dependencies=v1)
    async def model_info(name: str) -> dict[str, Any]:
        _check_model(name, config)
        return _model_card(config.model_name, context, vocab)

    @app.post("/v1/completions", dependencies=v1)
    async def completions(request: Request) -> Response:
        req = await _parse(request, CompletionRequest, config)
        prompts = _text_prompts(req.prompt, tokenizer)
        return await _run(request, req, prompts, False, req.max_tokens)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat(request: Request) -> Response:
        req = await _parse(request, ChatCompletionRequest, config)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        if not getattr(tokenizer, "chat_template", None):
            raise ServerError(400, f"{config.model_name} has no chat template; use /v1/completions", "messages")
        try:
            prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False))
        except Exception as exc:  # the template refused the messages (e.g. roles out of order)
            raise ServerError(400, f"the chat template cannot format these messages: {exc}", "messages") from None
        return await _run(request, req, [prompt], True, req.token_limit())

    async def _run(request: Request, req: Any, prompts: list[list[int]], chat: bool,
                   max_tokens: int | None) -> Response:
        for prompt in prompts:
            if not prompt:
                raise ServerError(400, "the prompt is empty", "messages" if chat else "prompt")
            if len(prompt) >= context:
                raise ServerError(400, f"the prompt has {len(prompt)} tokens; this model's context holds {context}, "
                                       f"leaving no room to generate", "messages" if chat else "prompt",
                                  code="context_length_exceeded")
            if req.min_tokens and len(prompt) + req.min_tokens > context:
                raise ServerError(400, f"the prompt has {len(prompt)} tokens; this model's context holds {context}, "
                                       f"leaving no room for min_tokens ({req.min_tokens})", "min_tokens")
        choices = len(prompts) * req.n
        limit = config.max_request_choices
        if choices > limit:
            raise ServerError(400, f"this request asks for {choices} choices ({len(prompts)} prompts x n={req.n}); "
                                   f"this server takes at most {limit} per request", "prompt" if len(prompts) > 1
                              else "n")
        longest = max(len(p) for p in prompts)
        if max_tokens is not None and longest + max_tokens > context:
            raise ServerError(400, f"this model's context holds {context} tokens; the prompt has {longest} and "
                                   f"max_tokens asks for {max_tokens} more ({longest + max_tokens})", "max_tokens",
                              code="context_length_exceeded")
        stop = req.stop_strings()
        fields: dict[str, Any] = {}
        if req.hispec.ignore_eos or req.stop_token_ids:  # vLLM's stop_token_ids end a choice as EOS does
            eos = set() if req.hispec.ignore_eos else set(default_eos)
            fields["eos_token_id"] = tuple(sorted(eos | set(req.stop_token_ids or ())))
        sample = (req.temperature if req.temperature is not None else 1.0) > 0
        if sample:  # temperature 0 is greedy decoding, which reads none of the sampling fields (OpenAI's rule)
            fields |= {"temperature": req.temperature or 1.0, "top_p": req.top_p if req.top_p is not None else 1.0,
                       "top_k": req.hispec.top_k, "drafter_invariant": req.hispec.drafter_invariant}
        try:  # the request's OpenAI fields onto the engine's SamplingParams (choice i samples with seed + i)
            sampling = engine.sampling_params.replace(
                max_new_tokens=max_tokens or context - longest, do_sample=sample, seed=req.seed, **fields)
            sampling.check_vocab(vocab)
        except HiSpecError as exc:
            raise ServerError(400, str(exc)) from None
        if req.hispec.top_k > vocab:  # checked at temperature 0 too: a value no request of this model can use
            raise ServerError(400, f"top_k={req.hispec.top_k} exceeds the vocabulary ({vocab} tokens); 0 or -1 "
                                   f"samples from all", "top_k")
        options = req.stream_options
        job = Job(chat, config.model_name, prompts, req.n, sampling, stop, req.stream,
                  bool(req.stream and options is not None and options.include_usage), req.return_token_ids,
                  req.hispec.return_stats)
        run = CompletionRun(server, tokenizer, metrics, job)
        await run.submit()
        if req.stream:
            return CompletionStream(run)
        answer = await run.answer(request.is_disconnected)
        if answer is None:  # the client went away: nobody reads this
            return Response(status_code=499)
        return JSONResponse(answer)

    return app


class RequestCounter:
    """ASGI middleware counting ``/v1`` requests by route and status (streamed responses included)."""

    ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions")

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            return await self.app(scope, receive, send)
        status = {"code": 499}  # unless a response starts: the client went away first

        async def send_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = next((r for r in self.ROUTES if path == r or path.startswith(r + "/")), "other")
            self.metrics.requests.labels(route, str(status["code"])).inc()


def _model_card(name: str, context: int, vocab: int) -> dict[str, Any]:
    """OpenAI's model object, with vLLM's ``max_model_len`` and the vocabulary size (random-token loads)."""
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "hispec", "max_model_len": context,
            "vocab_size": vocab}


def _check_model(name: str, config: ServerConfig) -> None:
    if name != config.model_name:
        raise ServerError(404, f"the model {name!r} does not exist on this server; it serves {config.model_name!r}",
                          "model", code="model_not_found")


async def _parse(request: Request, cls: type[BaseModel], config: ServerConfig) -> Any:
    """The request body as ``cls``: 413 too large, 400 not JSON, 422 wrong fields, 404 unknown model."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
        raise ServerError(413, f"the request body has {length} bytes; this server takes at most {config.max_body_bytes}")
    body = await request.body()
    if len(body) > config.max_body_bytes:
        raise ServerError(413, f"the request body has {len(body)} bytes; this server takes at most {config.max_body_bytes}")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ServerError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ServerError(400, "the request body must be a JSON object")
    try:
        req = cls.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"])
        raise ServerError(422, f"{param}: {err['msg']} (got {err.get('input')!r:.80})", param) from None
    _check_model(req.model, config)
    req.check_supported()
    if req.hispec.method is not None and req.hispec.method != request.app.state.engine.engine.method:
        raise ServerError(400, f"this server decodes with {request.app.state.engine.engine.method!r}; the "
                               f"method is fixed per server (start another hispec-serve for {req.hispec.method!r})",
                          "hispec.method")
    return req


def _text_prompts(prompt: Any, tokenizer: Any) -> list[list[int]]:
    """A completion's ``prompt``: a string, a list of strings, token ids or a list of token-id lists."""
    if isinstance(prompt, str):
        return [tokenizer(prompt)["input_ids"]]
    if not prompt:
        raise ServerError(400, "the prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [tokenizer(p)["input_ids"] for p in prompt]
    return [list(p) for p in prompt]
