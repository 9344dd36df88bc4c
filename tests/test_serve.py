"""hispec-serve: the OpenAI client against real servers on 127.0.0.1 (tiny random models, one SmolLM2 test).

What the server guarantees and these tests check: greedy output equals ``transformers``' ``generate``
token for token, alone or among 32 concurrent requests; a seeded sampled request equals the same
request decoded alone when the policy does not depend on the batch (``batch_aware=False``; each
request samples from its own generator, so only a batch-dependent policy, which drafts differently
and so consumes random numbers differently, changes its sample).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import time

import pytest
from openai import AsyncOpenAI

from conftest import LiveServer
from hispec_decode import HiSpecModel
from hispec_decode.serving import ServerConfig
from serve_support import (CHAT, MESSAGES, MODEL, TEXT, chat_base, chat_ids, chat_model, hf_greedy,  # noqa: F401 (fixtures)
                           long_base, reference, sse_chunks)


# -- the OpenAI client: output equal to transformers ----------------------------------------------
@pytest.mark.parametrize("method", ["autoregressive", "self_spec", "hispec"])
def test_openai_client_greedy_equals_generate(chat_model, reference, method):
    server = LiveServer(chat_model, method=method, num_blocks=64)
    try:
        client, tok = server.client(), chat_model.tokenizer
        messages = [{"role": "user", "content": "What is 2 plus 3?"}]
        prompt = chat_ids(chat_model, messages[0]["content"])
        want = hf_greedy(reference, prompt, 20)

        r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20,
                                           extra_body={"return_token_ids": True})
        choice = r.choices[0]
        assert choice.token_ids == want and choice.prompt_token_ids == prompt
        assert choice.message.content == tok.decode(want, skip_special_tokens=True)
        assert choice.finish_reason == "length" and choice.message.role == "assistant"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(prompt), 20, len(prompt) + 20)

        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20,
                                                     stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20

        text = "The sky is"
        prompt = tok(text)["input_ids"]
        want = hf_greedy(reference, prompt, 12)
        r = client.completions.create(model=MODEL, prompt=text, temperature=0, max_tokens=12)
        assert r.choices[0].text == tok.decode(want, skip_special_tokens=True)
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 12)
        streamed = list(client.completions.create(model=MODEL, prompt=text, temperature=0, max_tokens=12, stream=True))
        assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
        r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12,
                                      extra_body={"return_token_ids": True})  # token ids as the prompt
        assert r.choices[0].token_ids == want
        assert [m.id for m in client.models.list().data] == [MODEL]
    finally:
        server.close()


def test_stop_strings_and_n(chat_model, reference):
    server = LiveServer(chat_model, num_blocks=64)
    try:
        client, tok = server.client(), chat_model.tokenizer
        prompt = tok("Once upon")["input_ids"]
        full = tok.decode(hf_greedy(reference, prompt, 30), skip_special_tokens=True)
        stop = full[10:12]
        cut = full[: full.index(stop)]
        r = client.completions.create(model=MODEL, prompt="Once upon", temperature=0, max_tokens=30, stop=[stop])
        assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens < 30
        streamed = list(client.completions.create(model=MODEL, prompt="Once upon", temperature=0, max_tokens=30,
                                                  stop=stop, stream=True))
        assert "".join(c.choices[0].text for c in streamed) == cut
        r = client.completions.create(model=MODEL, prompt="Once upon", temperature=1.0, max_tokens=8, n=3, seed=5,
                                      extra_body={"return_token_ids": True})
        assert sorted(c.index for c in r.choices) == [0, 1, 2] and r.usage.completion_tokens == 24
        assert len({tuple(c.token_ids) for c in r.choices}) > 1  # each choice samples with its own seed
        for i, c in enumerate(r.choices):
            alone = client.completions.create(model=MODEL, prompt="Once upon", temperature=1.0, max_tokens=8, seed=5 + i,
                                              extra_body={"return_token_ids": True})
            assert alone.choices[0].token_ids == c.token_ids
        assert server.metric("hispec_cache_blocks_used") == 0
        assert server.metric("hispec_aborted_requests_total") == 0  # a stop string finishes a request
        _, text = server.request("GET", "/metrics")  # per level: L_f's counts are the full model's
        checked = dict(re.findall(r'^hispec_level_checked_tokens_total\{[^}]*level="([^"]+)"[^}]*\} (\S+)$', text, re.M))
        assert "L_f" in checked and float(checked["L_f"]) == server.metric("hispec_tentative_tokens_total")
    finally:
        server.close()


def test_a_finished_answer_is_already_in_metrics(chat_model, monkeypatch):
    """The engine publishes its /metrics snapshot before it hands a request its last tokens, so a
    client that has its answer finds it counted, however late the engine thread's periodic refresh
    runs (here it is delayed by 0.3 s)."""
    from hispec_decode.serving.async_engine import AsyncEngine

    publish = AsyncEngine._publish

    def late(self, force: bool = False) -> None:
        if not force:
            time.sleep(0.3)
        publish(self, force)

    monkeypatch.setattr(AsyncEngine, "_publish", late)
    server = LiveServer(chat_model, num_blocks=64)
    try:
        client, total = server.client(), 0
        for max_tokens in (3, 5):
            r = client.completions.create(model=MODEL, prompt="Once upon", temperature=0, max_tokens=max_tokens)
            total += r.usage.completion_tokens
            assert server.metric("hispec_generation_tokens_total") == total
            assert server.metric("hispec_cache_blocks_used") == 0
    finally:
        server.close()


# -- streamed chunks: nothing before the first token (time to first token as load generators see it)
def test_stream_sends_role_with_first_text_and_nothing_before(chat_model):
    """The first chunk of a choice carries its role and its first text, so ``vllm bench serve``
    (TTFT at the first chunk with choices) measures prefill; a choice that ends without text gets
    its role in its finishing chunk."""
    server = LiveServer(chat_model, num_blocks=64)
    try:
        full = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=10)
        text = full.choices[0].message.content
        assert text
        for stop, n in ((None, 2), (text[:1], 2)):  # then a stop string that ends both choices before any text
            body = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 10, "n": n, "stream": True,
                    "stream_options": {"include_usage": True}} | ({"stop": stop} if stop else {})
            items = [c["choices"][0] for c in sse_chunks(server, CHAT, body) if c["choices"]]
            assert items[0]["delta"].get("content") or items[0]["finish_reason"]
            for i in range(n):
                mine = [c for c in items if c["index"] == i]
                assert [k for k, c in enumerate(mine) if "role" in c["delta"]] == [0]
                assert mine[0]["delta"]["role"] == "assistant"
                assert mine[0]["delta"]["content"] or mine[0]["finish_reason"] == "stop"
                assert "".join(c["delta"].get("content") or "" for c in mine) == ("" if stop else text)

        body = {"model": MODEL, "prompt": "The sky is", "temperature": 0, "max_tokens": 6, "n": 2, "stream": True}
        items = [c["choices"][0] for c in sse_chunks(server, TEXT, body) if c["choices"]]
        for i in range(2):
            mine = [c for c in items if c["index"] == i]
            assert mine[0]["text"] or mine[0]["finish_reason"]

        chunks = list(server.client().chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                                              max_tokens=10, n=2, stream=True))
        for i in range(2):  # the OpenAI client reads the role and the text of the same chunk
            deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].index == i]
            assert deltas[0].role == "assistant" and deltas[0].content
            assert [d.role for d in deltas[1:]] == [None] * (len(deltas) - 1)
            assert "".join(d.content or "" for d in deltas) == text
    finally:
        server.close()


# -- vLLM's request fields (what `vllm bench serve` sends) ------------------------------------------
def vllm_payloads(prompt: str, max_tokens: int, ignore_eos: bool) -> dict[str, dict]:
    """The bodies ``vllm bench serve`` posts (openai and openai-chat backends, sampling via its extra body)."""
    text = {"model": MODEL, "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": max_tokens, "logprobs": None,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0, "top_p": 1.0, "top_k": -1,
            "min_p": 0.0}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "temperature": 0.0,
            "max_completion_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    extra = {"ignore_eos": True} if ignore_eos else {}
    return {TEXT: text | extra, CHAT: chat | extra}


def first(ids: list[int], stops: tuple[int, ...]) -> int:
    return next(i for i, t in enumerate(ids) if t in stops)


def test_vllm_bench_payloads_and_top_level_ignore_eos(chat_model, reference):
    """The server's EOS set holds a token greedy decoding reaches early: without ``ignore_eos`` each
    request stops there; with vLLM's top-level ``ignore_eos`` it runs to max_tokens."""
    prompt, n = "The sky is", 12
    ids = {TEXT: chat_model.tokenizer(prompt)["input_ids"], CHAT: chat_ids(chat_model, prompt)}
    want = {path: hf_greedy(reference, p, n) for path, p in ids.items()}
    eos = (want[TEXT][2], want[CHAT][2])
    server = LiveServer(chat_model, num_blocks=64, eos_token_id=eos)
    try:
        for ignore_eos in (False, True):
            for path, body in vllm_payloads(prompt, n, ignore_eos).items():
                chunks = sse_chunks(server, path, body)
                reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
                usage = chunks[-1]["usage"]
                if ignore_eos:
                    assert (usage["completion_tokens"], reasons[-1]) == (n, "length"), path
                else:
                    assert usage["completion_tokens"] <= 3 and reasons[-1] == "stop", path
            body = vllm_payloads(prompt, n, ignore_eos)[TEXT] | {"stream": False, "return_token_ids": True}
            del body["stream_options"]
            code, answer = server.request("POST", TEXT, body)
            assert code == 200, answer
            got = answer["choices"][0]["token_ids"]
            assert got == (want[TEXT] if ignore_eos else want[TEXT][: first(want[TEXT], eos) + 1])

        # vLLM's stop_token_ids join the EOS set (with ignore_eos: they alone end the choice)
        stop_id = want[TEXT][6]
        for ignore_eos in (False, True):
            end = first(want[TEXT], (stop_id,) if ignore_eos else (stop_id, *eos))
            body = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": n, "stop_token_ids": [stop_id],
                    "ignore_eos": ignore_eos, "return_token_ids": True}
            code, answer = server.request("POST", TEXT, body)
            assert code == 200, answer
            assert answer["choices"][0]["token_ids"] == want[TEXT][: end + 1]
            assert answer["choices"][0]["finish_reason"] == "stop"

        # min_tokens is met trivially when EOS cannot end the choice
        body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "min_tokens": n, "ignore_eos": True}
        code, answer = server.request("POST", TEXT, body)
        assert code == 200 and answer["usage"]["completion_tokens"] == n, answer
        for bad in ({"min_tokens": 4}, {"min_tokens": 4, "ignore_eos": True, "stop": "x"},
                    {"min_tokens": n + 1, "ignore_eos": True}):
            code, answer = server.request("POST", TEXT, {"model": MODEL, "prompt": prompt, "max_tokens": n} | bad)
            assert code == 400 and answer["error"]["param"] == "min_tokens", answer
    finally:
        server.close()


def test_top_level_top_k_is_hispec_top_k(chat_model):
    """vLLM's top-level ``top_k`` samples as the ``hispec`` extension's (-1, vLLM's "all", is 0)."""
    server = LiveServer(chat_model, num_blocks=64)
    try:
        def sample(**fields) -> list[int]:
            body = {"model": MODEL, "prompt": "Once upon", "temperature": 1.0, "max_tokens": 12, "seed": 11,
                    "return_token_ids": True} | fields
            code, answer = server.request("POST", TEXT, body)
            assert code == 200, answer
            return answer["choices"][0]["token_ids"]

        greedy = sample(temperature=0)
        assert sample(top_k=1) == sample(hispec={"top_k": 1}) == sample(top_k=1, hispec={"top_k": 1}) == greedy
        assert sample(top_k=3) == sample(hispec={"top_k": 3})
        assert sample(top_k=-1) == sample(top_k=0) == sample()
        body = {"model": MODEL, "prompt": "hi", "top_k": 2, "hispec": {"top_k": 3}}
        code, answer = server.request("POST", TEXT, body)
        assert code == 400 and answer["error"]["param"] == "top_k"
    finally:
        server.close()


# -- 32 concurrent streams ------------------------------------------------------------------------
def test_32_concurrent_streams_are_independent(chat_model, reference):
    server = LiveServer(chat_model, num_blocks=256, max_num_seqs=16, batch_aware=False)
    try:
        requests = []
        for i in range(32):
            kwargs = {"max_tokens": 4 + i % 13, "seed": 1000 + i}
            if i % 2:
                kwargs |= {"temperature": 0.6 + 0.1 * (i % 5), "top_p": 1.0 if i % 3 else 0.9}
            else:
                kwargs |= {"temperature": 0}
            requests.append(({"role": "user", "content": f"Question {i}: {'why ' * (i % 7)}?"}, kwargs))

        async def one(client: AsyncOpenAI, message, kwargs) -> tuple[str, list[int], str]:
            stream = await client.chat.completions.create(model=MODEL, messages=[message], stream=True,
                                                          extra_body={"return_token_ids": True}, **kwargs)
            text, ids, reason = "", [], None
            async for chunk in stream:
                for c in chunk.choices:
                    text += c.delta.content or ""
                    ids += c.token_ids  # each chunk's new tokens
                    reason = c.finish_reason or reason
            return text, ids, reason

        async def all_at_once():
            client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
            return await asyncio.gather(*(one(client, m, k) for m, k in requests))

        together = asyncio.run(all_at_once())
        assert server.metric("hispec_num_requests_running") == 0 and server.metric("hispec_cache_blocks_used") == 0
        client = server.client()
        for (message, kwargs), (text, ids, reason) in zip(requests, together):
            assert reason == "length" and len(ids) == kwargs["max_tokens"]
            assert text == chat_model.tokenizer.decode(ids, skip_special_tokens=True)
            alone = client.chat.completions.create(model=MODEL, messages=[message],
                                                   extra_body={"return_token_ids": True}, **kwargs)
            assert alone.choices[0].token_ids == ids, kwargs  # greedy and seeded sampled alike
            if kwargs["temperature"] == 0:
                assert ids == hf_greedy(reference, chat_ids(chat_model, message["content"]), kwargs["max_tokens"])
    finally:
        server.close()


# -- a client that goes away ------------------------------------------------------------------------
def test_disconnect_mid_stream_aborts_and_frees_blocks(long_base):
    model = HiSpecModel.from_pretrained(str(long_base))
    server = LiveServer(model, num_blocks=600)
    try:
        idle = server.metric("hispec_cache_blocks_used")
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 8000, "stream": True,
                "hispec": {"ignore_eos": True}}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")
        assert server.metric("hispec_cache_blocks_used") > idle
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        deadline = time.monotonic() + 10
        while server.metric("hispec_cache_blocks_used") != idle:
            assert time.monotonic() < deadline, "blocks were not freed after the client left"
            time.sleep(0.05)
        assert server.metric("hispec_aborted_requests_total") == 1
        assert server.metric("hispec_num_requests_running") == 0
        assert server.metric("hispec_generation_tokens_total") < 8000
    finally:
        server.close()


# -- SmolLM2 --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_chat_over_http_equals_generate():
    from hispec_decode.data.prompts import CHAT_PROMPTS, encode_prompt

    model = HiSpecModel.from_pretrained()
    server = LiveServer(model, ServerConfig(model.base_name), num_blocks=64)
    try:
        client = server.client()
        for text in CHAT_PROMPTS[:2]:
            want = model.generate([encode_prompt(model.tokenizer, text)], max_new_tokens=32).sequences[0]
            r = client.chat.completions.create(model=model.base_name, messages=[{"role": "user", "content": text}],
                                               temperature=0, max_tokens=32, extra_body={"return_token_ids": True})
            assert r.choices[0].token_ids == want
            assert r.choices[0].message.content == model.tokenizer.decode(want, skip_special_tokens=True)
    finally:
        server.close()


# -- the load generator runs ------------------------------------------------------------------------
def test_bench_serve_runs(long_base, tmp_path):
    from hispec_decode.tools.bench_serve import main

    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    assert main(["--launch", "autoregressive,hispec", "--base", str(long_base), "--heads", "none", "--concurrency",
                 "1,2", "--requests", "3", "--max-tokens", "6", "--prompts", "builtin", "--num-prompts", "2",
                 "--compare-generate", "--json", str(out), "--plot", str(png)]) == 0
    results = json.loads(out.read_text())
    for method in ("autoregressive", "hispec"):
        levels = results["servers"][method]["levels"]
        assert [lv["concurrency"] for lv in levels] == [1, 2]
        assert all(lv["requests"] == 3 and lv["failed"] == 0 and lv["output_tokens_per_second"] > 0 for lv in levels)
        overhead = results["servers"][method]["overhead"]
        assert overhead["equal_outputs"] == 2 and overhead["http_over_generate"] > 0
    assert png.stat().st_size > 10_000


def test_bench_serve_sends_vllm_bench_shaped_load(long_base, tmp_path):
    """Random-token prompts to /v1/completions with ignore_eos: every request is exactly max_tokens
    long, and vllm bench serve's figures are reported (here against a chunked-prefill server)."""
    from hispec_decode.tools.bench_serve import main

    out = tmp_path / "serve.json"
    assert main(["--launch", "autoregressive", "--base", str(long_base), "--heads", "none", "--concurrency", "2",
                 "--requests", "4", "--max-tokens", "6", "--random-input-len", "9", "--num-prompts", "3",
                 "--ignore-eos", "--prefill-chunk", "4", "--json", str(out)]) == 0
    (level,) = json.loads(out.read_text())["servers"]["autoregressive"]["levels"]
    assert level["failed"] == 0 and level["output_tokens"] == 4 * 6
    vllm = level["vllm"]
    assert vllm["output_throughput"] == pytest.approx(level["output_tokens_per_second"])
    assert 0 < vllm["median_ttft_ms"] <= vllm["p99_ttft_ms"] and vllm["mean_tpot_ms"] > 0 and vllm["p99_itl_ms"] > 0


def test_drafter_invariant_extension_gives_the_same_text_on_every_server(chat_model):
    """A seeded, drafter-invariant sample is the same text from an autoregressive and a hispec server
    (fp32), while each server's default rejection sampling is free to differ."""
    texts = {}
    for method in ("autoregressive", "hispec"):
        server = LiveServer(chat_model, method=method, num_blocks=64)
        try:
            r = server.client().completions.create(model=MODEL, prompt="Once upon", max_tokens=16, temperature=0.9,
                                                   seed=3, n=2, extra_body={"hispec": {"drafter_invariant": True},
                                                                             "return_token_ids": True})
            texts[method] = [c.token_ids for c in r.choices]
        finally:
            server.close()
    assert texts["autoregressive"] == texts["hispec"] and texts["hispec"][0] != texts["hispec"][1]
