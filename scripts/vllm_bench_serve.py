"""Three servers on the same weights under vLLM's own load generator (``vllm bench serve``), one at a time.

    python scripts/vllm_bench_serve.py --out docs/results/vllm-bench-serve        # from this project's venv

Servers: ``vllm serve`` plain, ``vllm serve`` with HiSpec heads (``hispec_vllm.speculative_config``),
optionally ``vllm serve`` with its ngram speculation, and ``hispec-serve`` (method hispec). Each is
started alone, loaded at every ``--concurrency`` with ``--num-prompts`` chat prompts (ShareGPT, written
in the ShareGPT format vLLM reads), greedy, ``--output-len`` tokens each (``--ignore-eos``), then
stopped. Writes OUT.json (per server and concurrency: output tokens/s, TTFT and ITL median/p99, and
vLLM's spec-decode acceptance rate and length) and OUT.png. vLLM runs from its own virtualenv
(``--vllm-python``, default ``.venv-vllm/bin/python``: scripts/_setup_vllm.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
FIELDS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
          "spec_decode_acceptance_rate", "spec_decode_acceptance_length", "completed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    start = time.time()
    while time.time() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"{url} not healthy after {timeout:.0f} s")


def sharegpt_file(n: int, path: Path) -> Path:
    from hispec_decode.data.prompts import prompt_set

    prompts = prompt_set("sharegpt", n)
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "-"}]}
            for i, p in enumerate(prompts)]
    path.write_text(json.dumps(rows))
    return path


def server_command(kind: str, args: argparse.Namespace, base: str, port: int) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND=args.omp_bind,
               VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib))
    if kind == "hispec-serve":
        return [str(Path(sys.executable).parent / "hispec-serve"), "--dtype", args.dtype, "--port", str(port)], env
    cmd = [args.vllm_python, "-m", "hispec_vllm.vllm_cli", "serve", base, "--dtype", args.dtype, "--port", str(port),
           "--served-model-name", SERVED_NAME, "--max-model-len", "2048"]
    if kind == "vllm-hispec":
        spec = subprocess.run([args.vllm_python, "-m", "hispec_vllm", *([args.heads] if args.heads else []),
                               *(["--num-speculative-tokens", str(args.k)] if args.k else [])],
                              check=True, capture_output=True, text=True).stdout.strip()
        cmd += ["--speculative-config", spec]
    elif kind == "vllm-ngram":
        cmd += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                                                     "prompt_lookup_min": 2, "prompt_lookup_max": 4})]
    return cmd, env


def bench(args: argparse.Namespace, base: str, url: str, data: Path, concurrency: int, out: Path) -> dict:
    name = f"c{concurrency}.json"
    cmd = [args.vllm_python, "-m", "hispec_vllm.vllm_cli", "bench", "serve", "--backend", "openai-chat",
           "--endpoint", "/v1/chat/completions", "--base-url", url, "--model", SERVED_NAME, "--tokenizer", base,
           "--dataset-name", "sharegpt", "--dataset-path", str(data), "--sharegpt-output-len", str(args.output_len),
           "--num-prompts", str(max(args.num_prompts, concurrency)), "--max-concurrency", str(concurrency),
           "--temperature", "0", "--ignore-eos", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl",
           "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out), "--result-filename", name]
    subprocess.run(cmd, check=True, env=dict(os.environ, VLLM_TARGET_DEVICE="cpu"))
    result = json.loads((out / name).read_text())
    return {k: result.get(k) for k in FIELDS}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for kind, levels in results.items():
        cs = sorted(int(c) for c in levels)
        a.plot(cs, [levels[str(c)]["output_throughput"] for c in cs], marker="o", label=kind)
        b.plot(cs, [levels[str(c)]["p99_itl_ms"] for c in cs], marker="o", label=kind)
    a.set(xscale="log", xlabel="concurrency", ylabel="output tokens/s", title="throughput (vllm bench serve)")
    b.set(xscale="log", xlabel="concurrency", ylabel="ms", title="p99 inter-token latency")
    for ax in (a, b):
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/results/vllm-bench-serve", help="OUT.json and OUT.png")
    p.add_argument("--servers", default="vllm-plain,vllm-hispec,vllm-ngram,hispec-serve")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per level (at least the concurrency)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--heads", default=None, help="adapter for vllm-hispec (default: the embedded heads)")
    p.add_argument("--k", type=int, default=None, help="num_speculative_tokens (default: the adapter's tuned one)")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--omp-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND for the servers")
    p.add_argument("--kv-cache-gib", type=int, default=2)
    args = p.parse_args()
    from hispec_decode.models.loading import default_base_dir

    base = str(default_base_dir())
    levels = [int(c) for c in args.concurrency.split(",")]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = sharegpt_file(max(args.num_prompts, max(levels)), Path(tmp) / "sharegpt.json")
        for kind in args.servers.split(","):
            port = free_port()
            cmd, env = server_command(kind, args, base, port)
            print(f"[{kind}] {' '.join(cmd)}", flush=True)
            with open(Path(tmp) / f"{kind}.log", "w") as log:
                proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                url = f"http://127.0.0.1:{port}"
                wait_healthy(url, proc)
                results[kind] = {}
                for c in levels:
                    results[kind][str(c)] = bench(args, base, url, data, c, Path(tmp) / kind)
                    print(f"[{kind}] concurrency {c}: {results[kind][str(c)]}", flush=True)
            finally:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"base": base, "dtype": args.dtype, "output_len": args.output_len, "num_prompts": args.num_prompts,
              "machine": f"{os.cpu_count()} CPU cores", "results": results}
    out.with_suffix(".json").write_text(json.dumps(report, indent=2, sort_keys=True))
    plot(results, out.with_suffix(".png"))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
