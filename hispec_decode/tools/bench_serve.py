"""``hispec-bench-serve``: a bounded load generator for OpenAI-compatible servers.

    hispec-bench-serve --url http://127.0.0.1:8000                      # a server that runs already
    hispec-bench-serve --launch autoregressive,hispec --dtype bfloat16   # start one server per method

At each concurrency level, that many clients send streamed chat requests (greedy, chat prompts) until
a fixed number of requests is done or a time limit passes; it reports requests/s, output tokens/s,
time to first token and inter-token latency (p50/p99; a chunk of k tokens after a gap g counts as k
gaps of g/k, since a speculative server commits several tokens at once), as JSON and a PNG, and
beside them the figures ``vllm bench serve`` prints, by its definitions (``vllm`` in the JSON:
TTFT, TPOT and per-chunk ITL, mean / median / p99). ``--random-input-len N --ignore-eos`` sends
the load ``vllm bench serve --dataset-name random --random-input-len N --ignore-eos`` sends
(random token ids to /v1/completions, every request exactly ``--max-tokens`` long).

``--compare-generate`` (with ``--launch``) measures the HTTP path's overhead: the same prompts,
one at a time, through the server and through ``model.generate`` in this process, interleaved prompt
by prompt (the server is idle while this process decodes and the reverse), as a ratio of tokens/s.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tqdm import tqdm

from ..config import METHODS
from ..data.prompts import PROMPT_SETS, encode_prompt, prompt_set
from ..errors import HiSpecError
from ..files import check_writable, write_text
from .args import add_model_args
from .bench_serve_report import plot, table
from .cli import add_debug_arg, positive_int, positive_int_list, run_cli

logger = logging.getLogger(__name__)


@dataclass
class Result:
    ok: bool
    tokens: int = 0
    ttft: float | None = None
    latency: float = 0.0
    gaps: list[float] = field(default_factory=list)  # per output token after the first chunk
    chunk_gaps: list[float] = field(default_factory=list)  # between chunks, as vllm bench serve's ITL counts
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    status: int | None = None  # the HTTP status (200 for a stream, also one that ended with an error event)
    error_type: str | None = None  # OpenAI's error type of a stream's final error event ("server_overloaded": 503)
    done: bool = False  # a stream that ended with ``data: [DONE]``


@dataclass(frozen=True)
class Load:
    """What each request asks for: its token limit, the endpoint of text prompts, ``ignore_eos``."""

    max_tokens: int
    endpoint: str = "chat"  # or "completions"
    ignore_eos: bool = False


class Target:
    """A server's address, model name and key."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        u = urlparse(url)
        self.host, self.port, self.api_key = u.hostname or "127.0.0.1", u.port or 80, api_key
        self.card = self.get("/v1/models")["data"][0]  # OpenAI's model object (hispec-serve adds vocab_size)
        self.model = self.card["id"]

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def get(self, path: str) -> Any:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        conn.request("GET", path, headers=self._headers())
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
        if resp.status != 200:
            raise HiSpecError(f"GET {path} answered {resp.status}: {body[:200]!r}")
        return json.loads(body)

    def chat(self, prompt: str | list[int], load: Load) -> Result:
        """One streamed greedy request (chat for a text prompt, unless the load says completions;
        token ids always go to /v1/completions), timed chunk by chunk."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": load.max_tokens, "temperature": 0, "stream": True,
                                "return_token_ids": True}
        if load.ignore_eos:
            body["ignore_eos"] = True
        if isinstance(prompt, str) and load.endpoint == "chat":
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
        else:
            path, body["prompt"] = "/v1/completions", prompt
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        try:
            conn.request("POST", path, json.dumps(body), self._headers())
            resp = conn.getresponse()
            if resp.status != 200:
                return Result(False, status=resp.status, error=f"HTTP {resp.status}: {resp.read()[:200]!r}")
            result, last, done = Result(True, status=200), None, False
            for line in resp:
                if line.startswith(b"data: [DONE]"):
                    done = True
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # the server ended the stream with an error event (e.g. 503: shutting down)
                    error = chunk["error"]
                    return Result(False, status=200, error=error["message"], error_type=error.get("type"),
                                  done=b"[DONE]" in resp.read())
                ids = [t for c in chunk["choices"] for t in c.get("token_ids") or []]
                if not ids:
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - t0
                else:
                    result.gaps += [(now - last) / len(ids)] * len(ids)
                    result.chunk_gaps.append(now - last)
                last = now
                result.token_ids += ids
            result.tokens, result.latency, result.done = len(result.token_ids), time.perf_counter() - t0, done
            if not done:
                return Result(False, status=200, tokens=result.tokens, error="the stream ended without [DONE]")
            return result
        except (OSError, http.client.HTTPException) as exc:
            return Result(False, error=repr(exc))
        finally:
            conn.close()


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, round(q / 100 * (len(v) - 1)))]


def vllm_metrics(ok: list[Result], wall: float) -> dict[str, float | None]:
    """The figures ``vllm bench serve`` prints, by its definitions: TTFT to the first chunk with
    output; TPOT = (latency - TTFT) / (output tokens - 1) per request; ITL = the gaps between chunks
    (a chunk of k speculated tokens is one gap); mean, median and p99 in ms."""
    ms = lambda x: None if x is None else 1000 * x  # noqa: E731
    series = {"ttft": [r.ttft for r in ok if r.ttft is not None],
              "tpot": [(r.latency - r.ttft) / (r.tokens - 1) for r in ok if r.ttft is not None and r.tokens > 1],
              "itl": [g for r in ok for g in r.chunk_gaps]}
    out: dict[str, float | None] = {"output_throughput": sum(r.tokens for r in ok) / wall,
                                    "request_throughput": len(ok) / wall}
    for name, values in series.items():
        out[f"mean_{name}_ms"] = ms(sum(values) / len(values)) if values else None
        out[f"median_{name}_ms"] = ms(percentile(values, 50))
        out[f"p99_{name}_ms"] = ms(percentile(values, 99))
    return out


def random_prompts(n: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` random token ids (``vllm bench serve --dataset-name random``'s shape;
    sent as ids, so every prompt has exactly that length)."""
    import random

    rng = random.Random(seed)
    low = min(1000, vocab_size // 4)  # clear of the special tokens at the start of most vocabularies
    return [[rng.randrange(low, vocab_size - 1) for _ in range(length)] for _ in range(n)]


def run_level(target: Target, prompts: list[str] | list[list[int]], concurrency: int, num_requests: int,
              load: Load, time_limit: float) -> dict[str, Any]:
    """``concurrency`` clients send requests (prompts in turn) until ``num_requests`` or ``time_limit``."""
    results: list[Result] = []
    lock, counter = threading.Lock(), iter(range(num_requests))
    t0 = time.perf_counter()
    bar = tqdm(total=num_requests, desc=f"concurrency {concurrency}", unit="req", leave=False)

    def client() -> None:
        while time.perf_counter() - t0 < time_limit:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            r = target.chat(prompts[i % len(prompts)], load)
            with lock:
                results.append(r)
                bar.update()

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    gaps = [g for r in ok for g in r.gaps]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    ms = lambda x: None if x is None else 1000 * x  # noqa: E731
    return {"concurrency": concurrency, "requests": len(results), "failed": len(results) - len(ok),
            "errors": sorted({r.error for r in results if not r.ok})[:5], "seconds": wall,
            "output_tokens": sum(r.tokens for r in ok),
            "requests_per_second": len(ok) / wall, "output_tokens_per_second": sum(r.tokens for r in ok) / wall,
            "ttft_ms_p50": ms(percentile(ttfts, 50)), "ttft_ms_p99": ms(percentile(ttfts, 99)),
            "itl_ms_p50": ms(percentile(gaps, 50)), "itl_ms_p99": ms(percentile(gaps, 99)),
            "latency_s_p50": percentile([r.latency for r in ok], 50), "vllm": vllm_metrics(ok, wall)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace, method: str) -> tuple[subprocess.Popen, str]:
    """Start ``hispec-serve`` for ``method`` on a free port; returns it once ``/health`` answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "hispec_decode.tools.serve", "--method", method, "--port", str(port),
           "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning"]
    cmd += ["--base", args.base] if args.base else []
    cmd += ["--heads", args.heads] if args.heads else []
    if args.batch_invariant is not None:
        cmd += ["--batch-invariant" if args.batch_invariant else "--no-batch-invariant"]
    cmd += ["--prefill-chunk", str(args.prefill_chunk)] if args.prefill_chunk else []
    log = tempfile.TemporaryFile()  # not a pipe: nobody reads it while the server runs
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 600
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            log.seek(0)
            raise HiSpecError(f"hispec-serve for {method} did not start: {log.read().decode(errors='replace')[-2000:]}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def generate_overhead(model: Any, target: Target, prompts: list[str], method: str, max_tokens: int) -> dict[str, Any]:
    """Concurrency 1, prompt by prompt: the server's streamed tokens/s over ``model.generate``'s."""
    model.generate([encode_prompt(model.tokenizer, prompts[0])], max_new_tokens=4, method=method)  # warm-up
    target.chat(prompts[0], Load(4))
    tokens = {"http": 0, "generate": 0}
    seconds = {"http": 0.0, "generate": 0.0}
    equal = 0
    for text in tqdm(prompts, desc=f"overhead {method}", unit="prompt", leave=False):
        t0 = time.perf_counter()
        out = model.generate([encode_prompt(model.tokenizer, text)], max_new_tokens=max_tokens, method=method)
        seconds["generate"] += time.perf_counter() - t0
        tokens["generate"] += len(out.sequences[0])
        r = target.chat(text, Load(max_tokens))
        if not r.ok:
            raise HiSpecError(f"request failed: {r.error}")
        seconds["http"] += r.latency
        tokens["http"] += r.tokens
        equal += r.token_ids == out.sequences[0]
    rate = {k: tokens[k] / seconds[k] for k in tokens}
    return {"prompts": len(prompts), "equal_outputs": equal, "generate_tokens_per_second": rate["generate"],
            "http_tokens_per_second": rate["http"], "http_over_generate": rate["http"] / rate["generate"]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hispec-bench-serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--launch", help="start hispec-serve for each of these methods in turn (comma-separated)")
    add_model_args(p)
    p.add_argument("--api-key", default=None, help="the server's API key (with --url)")
    p.add_argument("--max-num-seqs", type=positive_int, default=16, help="batch size of launched servers")
    p.add_argument("--concurrency", type=positive_int_list, default=[1, 4, 16], help="client counts (default: 1,4,16)")
    p.add_argument("--requests", type=positive_int, default=None,
                   help="requests per level (default: 4 x concurrency, at least 8)")
    p.add_argument("--max-tokens", type=positive_int, default=128)
    p.add_argument("--prompts", default="mixed", choices=PROMPT_SETS, help="prompt set (default: mixed chat)")
    p.add_argument("--num-prompts", type=positive_int, default=16)
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds per level at most (default: 300)")
    p.add_argument("--random-input-len", type=positive_int, default=None,
                   help="prompts of this many random token ids to /v1/completions (vllm bench serve's random data set)")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat", help="for text prompts")
    p.add_argument("--ignore-eos", action="store_true", help="every request generates --max-tokens tokens")
    p.add_argument("--prefill-chunk", type=positive_int, default=None, help="with --launch: the servers' chunked prefill")
    p.add_argument("--compare-generate", action="store_true",
                   help="with --launch: tokens/s through the server vs model.generate at concurrency 1")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="PNG of tokens/s, TTFT and ITL per level")
    add_debug_arg(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return run_cli("hispec-bench-serve", lambda: _run(args), args.debug)


def _run(args: argparse.Namespace) -> int:
    methods = args.launch.split(",") if args.launch else [None]
    for m in methods:
        if m is not None and m not in METHODS:
            raise HiSpecError(f"unknown method {m!r} in --launch; choose from {', '.join(METHODS)}")
    for output in (args.json, args.plot):  # before minutes of measuring, not after
        if output is not None:
            check_writable(output.parent, f"the directory of {output}")
    if args.compare_generate and not args.launch:
        raise HiSpecError("--compare-generate needs --launch (this process loads the same model)")
    prompts: list[Any] = prompt_set(args.prompts, args.num_prompts)
    load = Load(args.max_tokens, args.endpoint, args.ignore_eos)
    model = None
    if args.compare_generate:
        from ..api import HiSpecModel

        model = HiSpecModel.from_pretrained(args.base, args.heads, dtype=args.dtype, batch_invariant=args.batch_invariant)
    results: dict[str, Any] = {"dtype": args.dtype, "max_tokens": args.max_tokens, "prompts": args.prompts,
                               "servers": {}}
    for method in methods:
        proc, url = launch(args, method) if method else (None, args.url)
        try:
            target = Target(url, args.api_key)
            results["model"] = target.model
            name = method or url
            if args.random_input_len:
                vocab = target.card.get("vocab_size")
                if not isinstance(vocab, int):
                    raise HiSpecError("the server's model card gives no vocab_size; --random-input-len needs it")
                prompts = random_prompts(args.num_prompts, args.random_input_len, vocab)
            target.chat(prompts[0], Load(4))  # warm-up
            levels = []
            for c in args.concurrency:
                level = run_level(target, prompts, c, args.requests or max(8, 4 * c), load, args.time_limit)
                levels.append(level)
                logger.info("%s, concurrency %d: %.2f req/s, %.1f tok/s, TTFT p50 %.0f ms, ITL p50 %.1f ms (%d failed)",
                            name, c, level["requests_per_second"], level["output_tokens_per_second"],
                            level["ttft_ms_p50"] or 0, level["itl_ms_p50"] or 0, level["failed"])
            results["servers"][name] = {"levels": levels}
            if model is not None:
                overhead = generate_overhead(model, target, prompts, method, args.max_tokens)
                results["servers"][name]["overhead"] = overhead
                logger.info("%s: HTTP %.1f tok/s vs generate %.1f tok/s = %.2fx (%d/%d outputs equal)", name,
                            overhead["http_tokens_per_second"], overhead["generate_tokens_per_second"],
                            overhead["http_over_generate"], overhead["equal_outputs"], overhead["prompts"])
        finally:
            if proc is not None:
                stop(proc)
    if args.json:
        write_text(args.json, json.dumps(results, indent=2, sort_keys=True) + "\n")
    if args.plot:
        plot(results, args.plot)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
