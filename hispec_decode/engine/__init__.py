"""The engine: sequences and the decode loops of the strategies (autoregressive, self_spec,
hispec), the model runner that advances sequences through bands of layers, the scheduler, and the
continuous-batching ``LLMEngine``. The paged cache it runs on is :mod:`hispec_decode.cache`."""
