#!/usr/bin/env python
"""Where a server's inter-token latency goes, in the engine alone (no HTTP): a closed loop of 8
clients sends 32 requests of 64 random prompt tokens for 64 new tokens each (EOS ignored; the shape
of ``vllm bench serve --dataset-name random --random-input-len 64 --random-output-len 64
--ignore-eos --max-concurrency 8``), and every engine step's wall time is recorded beside the
number of newcomers it admitted.

    python scripts/serving_steps.py autoregressive [PREFILL_CHUNK]
"""

import random
import statistics
import sys
import time
from collections import Counter

from hispec_decode import HiSpecModel


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, round(q / 100 * (len(values) - 1)))] * 1000


def main() -> None:
    method = sys.argv[1] if len(sys.argv) > 1 else "autoregressive"
    chunk = int(sys.argv[2]) if len(sys.argv) > 2 else None
    model = HiSpecModel.from_pretrained(dtype="bfloat16")
    engine = model.build_engine(method=method, max_new_tokens=64, num_blocks=512, max_num_seqs=16, prefill_chunk=chunk)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, model.decoder.vocab_size - 1) for _ in range(64)] for _ in range(32)]
    engine.add_request(prompts[0][:8], max_new_tokens=4, eos_token_id=())  # warm-up
    while engine.has_unfinished():
        engine.step()
    arrival, emits, queue = {}, {}, iter(prompts)

    def add() -> None:
        prompt = next(queue, None)
        if prompt is not None:
            rid = engine.add_request(prompt, eos_token_id=())
            arrival[rid], emits[rid] = time.perf_counter(), []

    for _ in range(8):
        add()
    steps, t_start = [], time.perf_counter()
    while engine.has_unfinished():
        before = {s.seq_id for s in engine.scheduler.running}
        t0 = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        steps.append((now - t0, sum(s.seq_id not in before for s in engine.scheduler.running)))
        for o in outputs:
            if o.new_tokens:
                emits[o.request_id].append((now, len(o.new_tokens)))
            if o.finished:
                engine.release(o.request_id)
                add()
    wall = time.perf_counter() - t_start
    ttft = [emits[r][0][0] - arrival[r] for r in emits]
    itl = [b[0] - a[0] for r in emits for a, b in zip(emits[r], emits[r][1:])]
    tokens = sum(n for r in emits for _, n in emits[r])
    print(f"{method}, prefill_chunk {chunk}: {tokens / wall:.1f} tok/s, TTFT p50/p99 {pct(ttft, 50):.0f}/"
          f"{pct(ttft, 99):.0f} ms, ITL p50/p99 {pct(itl, 50):.0f}/{pct(itl, 99):.0f} ms")
    admitting = [d for d, n in steps if n]
    others = [d for d, n in steps if not n]
    print(f"  {len(steps)} steps: {len(admitting)} admitted newcomers (mean {1000 * statistics.mean(admitting):.0f} ms, "
          f"max {1000 * max(admitting):.0f}), {len(others)} did not (mean {1000 * statistics.mean(others):.0f} ms, "
          f"p99 {pct(others, 99):.0f})")
    print("  newcomers per admitting step (count: steps):", dict(sorted(Counter(n for _, n in steps if n).items())))


if __name__ == "__main__":
    main()
