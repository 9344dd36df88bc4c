"""``hispec-serve``: serve a base model (plus heads) over an OpenAI-compatible HTTP API.

    hispec-serve --dtype bfloat16 --port 8000
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'

The method and its policy are fixed for the server; sampling fields come with each request.
SIGTERM or Ctrl-C drains: new requests get HTTP 503 at once, running requests get
``--shutdown-timeout`` seconds to finish, the rest end with the documented 503 JSON error (a final
error event and ``[DONE]`` for a stream); then the server exits 0. A second Ctrl-C exits at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any

from ..config import EngineConfig, SpeculativeConfig, field_names
from ..errors import HiSpecError
from .args import add_config_args, add_model_args, config_overrides
from .cli import add_debug_arg, non_negative_float, port, positive_int, run_cli

API_KEY_ENV = "HISPEC_API_KEY"
HTTP_CLOSE_TIMEOUT_S = 5.0  # after the drain, how long uvicorn waits for connections to close


def begin_drain(engine: Any, server: Any, timeout: float) -> None:
    """SIGTERM's (or the first Ctrl-C's) effect: new requests get 503 from this moment on (the flag is set
    here, not when the event loop gets to the drain), running ones get ``timeout`` seconds to finish, then
    the HTTP server exits (``server.should_exit``). Before the engine's loop runs there is nothing to drain."""
    if not engine.wait_ready(0):
        server.should_exit = True
        return
    engine.accepting = False
    done = engine.drain_threadsafe(timeout)
    done.add_done_callback(lambda _: setattr(server, "should_exit", True))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hispec-serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000, help="port to listen on (default: 8000; 0: any free port)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: the base's name)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV}, else none)")
    p.add_argument("--max-queue", type=positive_int, default=256,
                   help="requests that may wait for a place in the batch; more get HTTP 503 (default: 256)")
    p.add_argument("--max-request-choices", type=positive_int, default=64,
                   help="choices (prompts x n) one request may ask for; more get HTTP 400 (default: 64)")
    p.add_argument("--shutdown-timeout", type=non_negative_float, default=10.0,
                   help="seconds running requests get to finish on SIGTERM before they are aborted (default: 10)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(max_num_seqs=16)
    for cls in (SpeculativeConfig, EngineConfig):  # per request: SamplingParams, from each request's fields
        add_config_args(p, cls, field_names(cls))
    add_debug_arg(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_cli("hispec-serve", lambda: _run(args), args.debug, extra="serve")


def _run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..api import HiSpecModel
    from ..serving import ServerConfig, build_app

    speculative = SpeculativeConfig(**config_overrides(args, field_names(SpeculativeConfig)))
    engine_config = EngineConfig(**config_overrides(args, field_names(EngineConfig)))
    model = HiSpecModel.from_pretrained(args.base, args.heads, dtype=args.dtype, batch_invariant=args.batch_invariant)
    engine = model.build_engine(speculative, engine_config)
    name = args.served_model_name or model.base_name
    config = ServerConfig(name, args.api_key, args.max_queue, args.max_request_choices,
                          shutdown_timeout=args.shutdown_timeout)
    app = build_app(model, engine, config, engine_thread=False)
    policy = engine.policy
    log = logging.getLogger(__name__)
    log.info("%s: method %s (draft L%s, verify L%s, window %s), %d KV blocks of %d tokens, up to %s sequences at once",
             name, speculative.method, policy.draft_layer, policy.verify_layer, policy.window,
             engine.cache.manager.num_blocks, engine.cache.manager.block_size, engine_config.max_num_seqs)
    # uvicorn's own graceful wait only backs up the drain below, which answers every request first
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=HTTP_CLOSE_TIMEOUT_S))
    # HTTP on a thread, the engine on this (main) thread: torch decodes faster on the main thread (AsyncEngine.run)
    http = threading.Thread(target=server.run, name="hispec-http", daemon=True)
    draining = threading.Event()

    def handle_exit(sig: int, frame: object) -> None:
        if draining.is_set():
            if sig == signal.SIGINT:  # a second Ctrl-C: stop waiting for running requests
                server.force_exit = server.should_exit = True
            return
        draining.set()
        log.info("draining: new requests get 503, running ones have %ss to finish", args.shutdown_timeout)
        begin_drain(app.state.engine, server, args.shutdown_timeout)

    signal.signal(signal.SIGTERM, handle_exit)
    signal.signal(signal.SIGINT, handle_exit)
    http.start()
    while not app.state.engine.wait_ready(0.5):
        if not http.is_alive():
            raise HiSpecError(f"the HTTP server did not start on {args.host}:{args.port} (see the log above)")
    # however the HTTP thread ends (a forced exit skips the lifespan shutdown), the engine loop stops
    threading.Thread(target=lambda: (http.join(), app.state.engine.request_stop()), daemon=True).start()
    app.state.engine.run()  # until the HTTP server has shut down
    http.join(timeout=args.shutdown_timeout + 30)
    if not server.started:
        raise HiSpecError(f"could not serve on {args.host}:{args.port} (see the log above; is the port in use?)")
    log.info("server stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
