"""Where does a speculative method's low-precision output first differ from plain decoding, and why?

For each benchmark prompt: decode with ``autoregressive`` and with ``--method`` in ``--dtype``; at
the first differing position, print transformers' top-2 logits for the shared prefix (one full
forward). Gaps of a few rounding steps mean a near-tie flipped by rounding (multi-token
verification passes round differently from one-token passes), not a rejection-rule error;
fp32 output is exactly equal and tested.

    python scripts/bf16_divergence.py    # the 8 prompts of the README benchmark
"""

from __future__ import annotations

import argparse

import torch

from hispec_decode import HiSpecModel
from hispec_decode.tools.bench import bench_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--method", default="hispec", choices=["hispec", "self_spec"])
    p.add_argument("--prompts", default="mixed")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    model = HiSpecModel.from_pretrained(dtype=args.dtype)
    for n, prompt in enumerate(bench_prompts(model, args.num_prompts, args.prompts)):
        plain = model.generate([prompt], max_new_tokens=args.max_new_tokens, method="autoregressive").sequences[0]
        spec = model.generate([prompt], max_new_tokens=args.max_new_tokens, method=args.method).sequences[0]
        i = next((j for j, (a, b) in enumerate(zip(plain, spec)) if a != b), None)
        if i is None:
            print(f"prompt {n}: identical ({len(plain)} tokens)")
            continue
        with torch.inference_mode():
            logits = model.base_model(torch.tensor([prompt + plain[:i]])).logits[0, -1].float()
        top = logits.topk(2)
        print(f"prompt {n}: first difference at token {i}: autoregressive {plain[i]}, {args.method} {spec[i]}; "
              f"transformers' top-2 logits {top.values.tolist()} for ids {top.indices.tolist()} "
              f"(gap {float(top.values[0] - top.values[1]):.4f})")


if __name__ == "__main__":
    main()
