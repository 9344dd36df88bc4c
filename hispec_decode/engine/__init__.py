"""The engine: sequences, the block manager and paged KV cache, the model runner that advances
sequences through bands of layers, the scheduler, and the continuous-batching ``LLMEngine``."""
