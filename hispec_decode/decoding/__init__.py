"""Decoding: the strategies (autoregressive, self_spec, hispec), their policy, token choice and
speculative verification."""
