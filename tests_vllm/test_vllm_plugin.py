"""HiSpec heads as vLLM's EAGLE drafter: lossless against vLLM without speculation, drafts that are the
base's own exit (accept-all when the upper layers add nothing) or a fixed token (reject-all), an exit
vocabulary, the default heads on the embedded SmolLM2, bad input, and sampling through vLLM's own
rejection sampler."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from conftest import DRAFT_LAYER, Run, exact_exit, fresh, generate, save_heads

from hispec_decode.errors import AdapterError
from hispec_vllm import speculative_config
from hispec_vllm.draft import build_draft_dir

PROMPTS = [[random.Random(i).randrange(3, 256) for _ in range(n)] for i, n in enumerate((5, 17, 40))]
NEW = 24


def acceptance(run: Run) -> float:
    return run.accepted / max(run.draft_tokens, 1)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_equals_vllm_without_speculation(arch, tiny_bases, tmp_path):
    """fp32 greedy, token for token: heads that reject everything on the random base, and heads that
    accept everything on a base whose exit at L_d is exact (the zero-initialised head is then the final
    prediction), each against vLLM without speculation."""
    base = tiny_bases[arch]
    plain = generate(base.path, PROMPTS, NEW)
    reject = generate(base.path, PROMPTS, NEW, speculative_config(save_heads(fresh(base), tmp_path / "reject", reject=True), 2))
    assert reject.tokens == plain.tokens
    assert reject.draft_tokens > 0 and acceptance(reject) < 0.2, (reject.accepted, reject.draft_tokens)

    model = fresh(base)
    exact_exit(model, DRAFT_LAYER)
    path = tmp_path / "exact-exit"
    model.save_pretrained(path)
    plain = generate(path, PROMPTS, NEW)
    accept = generate(path, PROMPTS, NEW, speculative_config(save_heads(model, tmp_path / "accept"), 3))
    assert accept.tokens == plain.tokens
    assert accept.draft_tokens > 0 and acceptance(accept) == 1.0, (accept.accepted, accept.draft_tokens)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_feature_attention_heads_are_lossless(arch, tiny_bases, tmp_path):
    """A feature_attention draft head (the base's L_d layers, then the head's own decoder layer over
    [h ; context] with K/V pages of its own): reject-all on the random base, accept-all on a base whose
    exit is exact (the head's layer, a copy of the base's layer L_d, then adds nothing), and a head with
    a random fusion on the random base, each equal to vLLM without speculation."""
    base = tiny_bases[arch]
    plain = generate(base.path, PROMPTS, NEW)
    reject = generate(base.path, PROMPTS, NEW, speculative_config(
        save_heads(fresh(base), tmp_path / "reject", reject=True, head_type="feature_attention"), 2))
    assert reject.tokens == plain.tokens
    assert reject.draft_tokens > 0 and acceptance(reject) < 0.2, (reject.accepted, reject.draft_tokens)
    noisy = save_heads(fresh(base), tmp_path / "noisy", head_type="feature_attention")
    from safetensors.torch import load_file, save_file

    tensors = load_file(noisy / "hispec_heads.safetensors")
    tensors[f"{DRAFT_LAYER}.fuse.weight"] = torch.randn_like(tensors[f"{DRAFT_LAYER}.fuse.weight"]) * 0.05
    save_file(tensors, noisy / "hispec_heads.safetensors", metadata={"format": "pt"})
    assert generate(base.path, PROMPTS, NEW, speculative_config(noisy, 3)).tokens == plain.tokens

    model = fresh(base)
    exact_exit(model, DRAFT_LAYER)
    path = tmp_path / "exact-exit"
    model.save_pretrained(path)
    plain = generate(path, PROMPTS, NEW)
    accept = generate(path, PROMPTS, NEW, speculative_config(save_heads(model, tmp_path / "accept",
                                                                        head_type="feature_attention"), 3))
    assert accept.tokens == plain.tokens
    assert accept.draft_tokens > 0 and acceptance(accept) == 1.0, (accept.accepted, accept.draft_tokens)


def test_exit_vocabulary_drafts_only_its_tokens(tiny_bases, tmp_path):
    """An exit vocabulary holding half the tokens: drafts outside it are impossible, so on a base whose
    exit is exact the accepted share equals the share of outputs inside the vocabulary; still lossless."""
    model = fresh(tiny_bases["llama"])
    exact_exit(model, DRAFT_LAYER)
    path = tmp_path / "base"
    model.save_pretrained(path)
    plain = generate(path, PROMPTS, NEW)
    vocab = torch.tensor(sorted({t for out in plain.tokens for t in out}))[::2].contiguous()  # half the output tokens
    spec = generate(path, PROMPTS, NEW, speculative_config(save_heads(model, tmp_path / "heads", exit_vocab=vocab), 1))
    assert spec.tokens == plain.tokens
    assert 0 < spec.accepted < spec.draft_tokens


def test_default_heads_on_smollm2_fp32_are_lossless():
    """The shipped heads on the embedded SmolLM2 (fp32): vLLM + HiSpec == vLLM, on chat prompts."""
    from transformers import AutoTokenizer

    from hispec_decode.models.loading import default_base_dir

    base = default_base_dir()
    tok = AutoTokenizer.from_pretrained(base)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"]
               for q in ("What is the capital of France?", "Write a haiku about the sea.")]
    plain = generate(base, prompts, 32, tokenizer=True)
    spec = generate(base, prompts, 32, speculative_config(), tokenizer=True)
    assert spec.tokens == plain.tokens
    # the trained head drafts tokens the base accepts (untrained exits: ~4% on held-out tokens)
    assert acceptance(spec) > 0.1, (spec.accepted, spec.draft_tokens)


@pytest.mark.xfail(strict=True, reason="vLLM 0.32.0's CPU build: sampled speculative decoding is not exact, for its "
                   "own draft_model method too (the recovered tokens come from wrong target probabilities); plain "
                   "vLLM sampling passes this test. Strict: it fails once vLLM fixes it, so the claim gets updated.")
def test_sampling_keeps_the_base_distribution(tiny_bases, tmp_path):
    """temperature 1: vLLM's rejection sampler, random path (EAGLE drafts greedily, so the draft is
    one-hot: ``draft_probs`` None), with the zero-initialised head; the two sampled tokens' frequencies over
    600 requests against the base's exact two-step distribution (transformers, fp32), chi-square at 99.9%."""
    model = fresh(tiny_bases["llama"])
    with torch.no_grad():  # a peaked distribution over few tokens, so the test has power
        model.lm_head.weight.mul_(8.0)
    path = tmp_path / "sharp"
    model.save_pretrained(path)
    prompt = PROMPTS[1]
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), -1)
        exact: dict[tuple[int, int], float] = {}
        for a in torch.nonzero(p1 > 1e-4).flatten().tolist():
            p2 = torch.softmax(model(torch.tensor([prompt + [a]])).logits[0, -1].double(), -1)
            for b in torch.nonzero(p2 * p1[a] > 1e-5).flatten().tolist():
                exact[(a, b)] = float(p1[a] * p2[b])
    n = 600
    run = generate(path, [prompt] * n, 2, speculative_config(save_heads(model, tmp_path / "heads"), 1), temperature=1.0)
    counts: dict[tuple[int, int], int] = {}
    for out in run.tokens:
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    cells = [(counts.get(k, 0), p * n) for k, p in exact.items() if p * n >= 5]
    rest_obs = n - sum(o for o, _ in cells)
    rest_exp = n - sum(e for _, e in cells)
    stat = sum((o - e) ** 2 / e for o, e in cells) + ((rest_obs - rest_exp) ** 2 / rest_exp if rest_exp >= 5 else 0)
    df = len(cells) - (0 if rest_exp >= 5 else 1)
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    assert run.draft_tokens > 0
    assert stat < critical, (stat, critical, df)


def test_bad_input_is_refused_clearly(tiny_bases, tmp_path):
    base = tiny_bases["llama"]
    heads = save_heads(fresh(base), tmp_path / "heads")
    with pytest.raises(ValueError, match="positive integer"):
        speculative_config(heads, 0)
    (heads / "vllm_base_config.json").unlink()
    with pytest.raises(AdapterError, match="hispec-export"):
        speculative_config(heads)
    cfg = json.loads(json.dumps(base.model.config.to_dict()))
    (heads / "vllm_base_config.json").write_text(json.dumps(cfg | {"hidden_size": 64}))
    with pytest.raises(AdapterError, match="does not describe"):
        build_draft_dir(heads)
    (heads / "vllm_base_config.json").write_text(json.dumps(cfg | {"model_type": "opt"}))
    with pytest.raises(AdapterError, match="llama, qwen2, qwen3"):
        build_draft_dir(heads)
    with pytest.raises(AdapterError, match="not found"):
        speculative_config(tmp_path / "missing")


def test_heads_for_another_base_are_refused_by_the_drafter(tiny_bases, tmp_path):
    """Heads trained on the llama tiny model, served on another llama of the same shape."""
    base = tiny_bases["llama"]
    heads = save_heads(fresh(base), tmp_path / "heads")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_config(base.model.config).eval()
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(Exception, match="trained for"):
        generate(tmp_path / "other", PROMPTS[:1], 4, speculative_config(heads, 1))


def test_the_readme_example_runs(tiny_bases, tmp_path):
    """The README's vLLM block, with BASE and HEADS a tiny model and its heads."""
    import re
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "import vllm" in b)
    base = tiny_bases["llama"]
    scope = {"BASE": str(base.path), "HEADS": str(save_heads(fresh(base), tmp_path / "heads"))}
    import vllm

    real = vllm.LLM

    def llm(**kwargs):  # the block's engine, with what a tiny tokenizer-less model needs
        return real(**kwargs, skip_tokenizer_init=True, dtype="float32", max_model_len=256, enforce_eager=True)
    vllm.LLM = llm
    try:
        exec(compile(block, "README.md", "exec"), scope)  # noqa: S102 - our own README
    finally:
        vllm.LLM = real
    llm_ = scope["llm"]
    out = llm_.generate([vllm.inputs.TokensPrompt(prompt_token_ids=PROMPTS[0])],
                        vllm.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    del llm_, scope
    import gc

    gc.collect()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
