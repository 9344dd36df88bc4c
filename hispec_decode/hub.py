"""Before asking the Hugging Face Hub for a name that is not a local path: is it a repo id at all,
is it cached, and can the Hub be reached? Each answer that rules the fetch out is one clear error at
once, where ``huggingface_hub`` would retry for half a minute first.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

from .errors import HiSpecError

PROBE_TIMEOUT_S = 3.0
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def endpoint() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


def check_fetchable(name: str, what: str, cached_file: str) -> None:
    """Raise where ``name`` (not a local path) cannot be fetched from the Hub: not a repo id, or not in
    the local Hugging Face cache (``cached_file`` there) while the Hub is offline or unreachable."""
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise HiSpecError(f"{what} {name!r} is neither a local path nor a Hugging Face Hub repo id") from None
    if isinstance(try_to_load_from_cache(name, cached_file), str):
        return
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE") or constants.HF_HUB_OFFLINE
    if offline:
        raise HiSpecError(f"{what} {name!r} is not a local path nor in the Hugging Face cache, and HF_HUB_OFFLINE is "
                          f"set")
    problem = unreachable()
    if problem:
        raise HiSpecError(f"{what} {name!r} is not a local path nor in the Hugging Face cache, and the Hub cannot be "
                          f"reached ({problem})")


def unreachable() -> str | None:
    """Why the Hub's endpoint cannot be reached (one TCP connect), or None. Behind a proxy the answer
    is the proxy's to give: None."""
    if any(os.environ.get(v) for v in PROXY_VARIABLES):
        return None
    url = urlparse(endpoint())
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as exc:
        return f"{endpoint()}: {exc.strerror or exc}"
    return None
