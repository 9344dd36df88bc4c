"""Benchmark prompt sets from the data packages (ShareGPT, HumanEval)."""

from __future__ import annotations

import pytest

from hispec_decode import HiSpecError
from hispec_decode.data.prompts import CHAT_PROMPTS, prompt_set


def test_prompt_sets():
    assert prompt_set("builtin", 3) == CHAT_PROMPTS[:3]
    share = prompt_set("sharegpt", 4)
    assert len(share) == 4 and len(set(share)) == 4 and all(20 <= len(p) <= 1500 for p in share)
    code = prompt_set("humaneval", 3)
    assert all(p.startswith("Complete the following Python function.") and "def " in p for p in code)
    mixed = prompt_set("mixed", 5)
    assert len(mixed) == 5 and sum("```python" in p for p in mixed) >= 2
    assert prompt_set("sharegpt", 4) == share  # seeded: the same prompts every run
    assert prompt_set("sharegpt", 4, seed=1) != share  # tuning draws others than the benchmarks
    plain = prompt_set("continuation", 3)
    assert len(plain) == 3 and all(200 < len(t) <= 400 for t in plain)
    with pytest.raises(HiSpecError, match="unknown prompt set"):
        prompt_set("mmlu", 2)
