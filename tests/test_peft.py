"""A base given as a PEFT LoRA adapter directory is merged, for decoding and for fingerprints."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from conftest import read_by
from hispec_decode import HiSpecModel
from hispec_decode.adapter import compute_fingerprint, fingerprints_match


def test_lora_adapter_directory_is_merged(tiny_models, tmp_path):
    base_dir = tiny_models["llama"].path
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)  # a non-trivial update (B is zero at initialisation)
    lora.save_pretrained(tmp_path / "lora")
    merged = lora.merge_and_unload().eval()

    hm = HiSpecModel.from_pretrained(str(tmp_path / "lora"))
    prompt = [5, 17, 3, 99, 42]
    ids = torch.tensor([prompt])
    ref = merged.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert ref != tiny_models["llama"].hf_generate(prompt, 16)  # the adapter changes the output ...
    for method in ("autoregressive", "hispec"):  # ... and HiSpec decodes the merged model exactly
        assert hm.generate([prompt], max_new_tokens=16, **read_by(method, draft_layer=1, verify_layer=3)).sequences[0] == ref
    assert fingerprints_match(compute_fingerprint(merged), compute_fingerprint(hm.base_model))
    assert not fingerprints_match(compute_fingerprint(tiny_models["llama"].reference), compute_fingerprint(hm.base_model))
