"""How often vLLM + HiSpec equals vLLM without speculation in bf16 (SmolLM2, default heads, greedy).

    .venv-vllm/bin/python scripts/vllm_bf16_equality.py [--dtype bfloat16] [--max-tokens 128] [--out FILE.json]

In fp32 the two are equal token for token (tests_vllm). In bf16 a verification pass scores k + 1
tokens in one call where plain decoding scores one, so the GEMM shapes differ and the last bits of a
logit may too; where two candidates are that close, the argmax flips and the texts diverge from there.
Prints, per built-in chat prompt, whether the outputs are equal and where they first differ.
"""

from __future__ import annotations

import argparse
import gc
import json
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "all")


def run(base: str, prompts: list[list[int]], dtype: str, max_tokens: int, spec: dict | None) -> list[list[int]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=base, dtype=dtype, max_model_len=1024, enforce_eager=True, seed=0, max_num_seqs=16,
              speculative_config=spec)
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        del llm
        gc.collect()
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from transformers import AutoTokenizer

    from hispec_decode.data.prompts import CHAT_PROMPTS, encode_prompt
    from hispec_decode.models.loading import default_base_dir
    from hispec_vllm import speculative_config

    base = str(default_base_dir())
    tok = AutoTokenizer.from_pretrained(base)
    prompts = [encode_prompt(tok, q) for q in CHAT_PROMPTS]
    plain = run(base, prompts, args.dtype, args.max_tokens, None)
    spec = run(base, prompts, args.dtype, args.max_tokens, speculative_config())
    first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(plain, spec)]
    result = {"dtype": args.dtype, "max_tokens": args.max_tokens, "prompts": len(prompts),
              "equal": sum(d is None for d in first_diff), "first_difference": first_diff}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2, sort_keys=True)


if __name__ == "__main__":
    main()
