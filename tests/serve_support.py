"""What the hispec-serve tests share: tiny random chat models with the character tokenizer, and the
transformers reference their greedy answers are compared with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from conftest import COMMON, LLAMA_LIKE, SERVED_MODEL, LiveServer, save_char_tokenizer
from hispec_decode import HiSpecModel

MODEL = SERVED_MODEL
KEY = "sk-test"
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def save_chat_llama(path: Path, context: int = 128) -> Path:
    """A tiny random Llama with the character tokenizer and a chat template (``context`` positions)."""
    torch.manual_seed(0)
    config = LlamaConfig(**(COMMON | {"max_position_embeddings": context}), **LLAMA_LIKE)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(2.0)
    model.save_pretrained(path)
    save_char_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def chat_base(tmp_path_factory) -> Path:
    return save_chat_llama(tmp_path_factory.mktemp("chat-llama"))


@pytest.fixture(scope="module")
def long_base(tmp_path_factory) -> Path:
    """Room for thousands of tokens, so a request is still running when its client goes away."""
    return save_chat_llama(tmp_path_factory.mktemp("long-llama"), context=8192)


@pytest.fixture(scope="module")
def chat_model(chat_base) -> HiSpecModel:
    return HiSpecModel.from_pretrained(str(chat_base))


@pytest.fixture(scope="module")
def reference(chat_base):
    return AutoModelForCausalLM.from_pretrained(str(chat_base)).eval()


def hf_greedy(reference, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def chat_ids(model: HiSpecModel, text: str) -> list[int]:
    return list(model.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False))


def sse_chunks(server: LiveServer, path: str, body: dict) -> list[dict]:
    """The ``data:`` objects of a streamed response, in order (without ``[DONE]``)."""
    status, text = server.request("POST", path, body)
    assert status == 200, text
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# fixtures (import them by name into a test module)
__all__ = ["CHAT", "KEY", "MESSAGES", "MODEL", "TEXT", "chat_base", "chat_ids", "chat_model", "hf_greedy", "long_base",
           "reference", "save_chat_llama", "sse_chunks"]
