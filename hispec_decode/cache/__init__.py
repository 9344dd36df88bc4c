"""The bottom layer: a torch-free block manager (``block_manager.py``: blocks, tables, band
lengths) and the paged K/V pools addressed through its tables (``kv_cache.py``). Nothing here
imports anything above it."""
