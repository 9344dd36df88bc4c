"""``hispec-serve``: an OpenAI-compatible HTTP server on the continuous-batching engine.

``app.py`` (routes, errors, auth), ``completions.py`` (one request's choices, JSON and SSE answers),
``async_engine.py`` (the engine thread), ``detokenize.py`` (streamed text, stop strings),
``metrics.py`` (Prometheus), ``protocol.py`` (request bodies). Needs the ``serve`` extra
(``pip install hispec[serve]``).
"""

from ..extras import require

require("serve", "hispec_decode.serving")

from .app import ServerConfig, build_app  # noqa: E402

__all__ = ["ServerConfig", "build_app"]
