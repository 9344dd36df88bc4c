"""Decoding math, free of engine state: token choice and speculative verification
(``sampling.py``) and the policy a speculative config resolves to (``policy.py``). The decode loops
that use them are the engine's (:mod:`hispec_decode.engine.strategies`)."""
