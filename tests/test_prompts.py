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


def test_code_prompts_hold_out_what_the_benchmarks_draw():
    """``rewrite`` rewrites only HumanEval problems held out from training; ``sharegpt-code`` keeps
    ShareGPT's requests about code and, as every training source, none the benchmarks draw."""
    from hispec_decode.data.prompts import (CODE_REQUEST, _humaneval, evaluation_prompts, humaneval_problems,
                                            rewrite_problems, sharegpt_code_turns, sharegpt_first_turns)
    from hispec_train.selfdistill import collect_prompts

    held_out = evaluation_prompts()
    rewritten = {p["canonical_solution"] for p, q in zip(_humaneval(), humaneval_problems()) if q in held_out}
    trained = {p["canonical_solution"] for p, q in zip(_humaneval(), humaneval_problems()) if q not in held_out}
    assert rewritten and trained, "HumanEval splits into held-out and training problems"
    rewrites = prompt_set("rewrite", 8) + prompt_set("rewrite", 8, seed=1)
    assert all(any(s in r for s in rewritten) and not any(s in r for s in trained) for r in rewrites)
    assert len(rewrite_problems()) == len(rewritten)
    code = prompt_set("code", 6)
    assert sum(p.startswith("Complete the following") for p in code) == 3 and len(set(code)) == 6

    asks = sharegpt_code_turns()
    assert 0 < len(asks) < len(sharegpt_first_turns(4000)) and all(CODE_REQUEST.search(t) for t in asks)
    assert CODE_REQUEST.search("How do I fix this function so it returns a list?")
    assert not CODE_REQUEST.search("What are the main causes of the French Revolution?")
    sources = collect_prompts(["sharegpt-code", "humaneval"])
    assert {s for s, _ in sources} == {"sharegpt-code", "humaneval"}
    assert not {t for _, t in sources} & held_out
    # the prompt set sharegpt-code: requests about code no training source holds; tuning's seed shares none with the benchmarks'
    bench_asks, tune_asks = prompt_set("sharegpt-code", 20), prompt_set("sharegpt-code", 20, seed=1)
    assert len(set(bench_asks)) == len(set(tune_asks)) == 20 and not set(bench_asks) & set(tune_asks)
    assert all(CODE_REQUEST.search(t) and t in held_out for t in bench_asks + tune_asks)
    with pytest.raises(HiSpecError, match="sharegpt-code prompt set holds"):
        prompt_set("sharegpt-code", 400)
    with pytest.raises(HiSpecError, match="drawn with seed 0 or 1"):
        prompt_set("sharegpt-code", 4, seed=7)


def test_held_out_sets_are_in_no_training_tuning_or_calibration_source():
    """``code-requests`` and ``passages`` share no prompt, and no 60-character stretch, with any source the
    self-distillation, tuning or calibration draws from; hispec-tune does not offer them."""
    from hispec_decode.adapter.vocabulary import CALIBRATION_PROMPTS
    from hispec_decode.data.prompts import HELD_OUT, continuation_texts, sharegpt_first_turns
    from hispec_decode.tools.tune import build_parser
    from hispec_train.selfdistill import DEFAULT_SOURCES, collect_prompts

    requests, passages = prompt_set("code-requests", 24), prompt_set("passages", 12)
    assert len(set(requests)) == 24 and len(set(passages)) == 12
    assert prompt_set("code-requests", 5) == requests[:5]  # in order, so per-prompt ratios line up across runs
    with pytest.raises(HiSpecError, match="holds 12 prompts"):
        prompt_set("passages", 13)
    sources = [t for _, t in collect_prompts(["sharegpt", "sharegpt-code", "humaneval", "continuation",
                                              *DEFAULT_SOURCES])]
    sources += list(sharegpt_first_turns(4000)) + list(continuation_texts()) + list(CHAT_PROMPTS)
    sources += list(CALIBRATION_PROMPTS)
    text = "\n".join(sources)
    for prompt in requests + passages:
        assert not any(prompt[i : i + 60] in text for i in range(0, max(1, len(prompt) - 60), 20)), prompt[:60]
    tune_sets = next(a for a in build_parser()._actions if a.dest == "prompts").choices
    assert not set(HELD_OUT) & set(tune_sets)
