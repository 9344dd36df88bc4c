"""hispec-serve's admission: bad requests get OpenAI-style errors, the API key, a full queue, bad options."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time

import pytest
from openai import OpenAI

from conftest import LiveServer
from hispec_decode import HiSpecModel
from hispec_decode.serving import ServerConfig
from serve_support import CHAT, KEY, MESSAGES, MODEL, TEXT, chat_base, chat_model, long_base  # noqa: F401 (fixtures)


# -- bad input: OpenAI-style errors ---------------------------------------------------------------
@pytest.fixture(scope="module")
def guarded(chat_model):
    server = LiveServer(chat_model, ServerConfig(MODEL, api_key=KEY, max_queue=1, max_body_bytes=20_000),
                        num_blocks=64, max_num_seqs=1)
    yield server
    server.close()


MESSAGES = [{"role": "user", "content": "hi"}]
BAD = {
    "unknown model": (TEXT, {"model": "gpt-4", "prompt": "hi"}, 404),
    "empty prompt": (TEXT, {"model": MODEL, "prompt": ""}, 400),
    "empty token prompt": (TEXT, {"model": MODEL, "prompt": []}, 400),
    "empty messages": (CHAT, {"model": MODEL, "messages": []}, 422),
    "prompt longer than the context": (TEXT, {"model": MODEL, "prompt": "x" * 200}, 400),
    "max_tokens 0": (TEXT, {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 422),
    "max_tokens not an integer": (TEXT, {"model": MODEL, "prompt": "hi", "max_tokens": 2.5}, 422),
    "max_tokens a string": (CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": "8"}, 422),
    "temperature < 0": (CHAT, {"model": MODEL, "messages": MESSAGES, "temperature": -0.5}, 422),
    "top_p 0": (CHAT, {"model": MODEL, "messages": MESSAGES, "top_p": 0}, 422),
    "top_p above 1": (TEXT, {"model": MODEL, "prompt": "hi", "top_p": 1.5}, 422),
    "token id outside the vocabulary": (TEXT, {"model": MODEL, "prompt": [5, 100000]}, 400),
    "unsupported logprobs": (TEXT, {"model": MODEL, "prompt": "hi", "logprobs": 3}, 400),
    "another method": (TEXT, {"model": MODEL, "prompt": "hi", "hispec": {"method": "self_spec"}}, 400),
    "unknown hispec option": (TEXT, {"model": MODEL, "prompt": "hi", "hispec": {"windwo": 3}}, 422),
    "unknown field": (TEXT, {"model": MODEL, "prompt": "hi", "foo_bar": 1}, 400),
    "unknown chat field": (CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokns": 4}, 400),
    "a completions-only field in chat": (CHAT, {"model": MODEL, "messages": MESSAGES, "suffix": "x"}, 400),
    "repetition_penalty": (TEXT, {"model": MODEL, "prompt": "hi", "repetition_penalty": 1.2}, 400),
    "min_p": (CHAT, {"model": MODEL, "messages": MESSAGES, "min_p": 0.1}, 400),
    "min_tokens without ignore_eos": (TEXT, {"model": MODEL, "prompt": "hi", "min_tokens": 2}, 400),
    "top_k below -1": (TEXT, {"model": MODEL, "prompt": "hi", "top_k": -2}, 422),
    "ignore_eos twice, differently": (TEXT, {"model": MODEL, "prompt": "hi", "ignore_eos": False,
                                             "hispec": {"ignore_eos": True}}, 400),
    "stop_token_ids not ids": (TEXT, {"model": MODEL, "prompt": "hi", "stop_token_ids": ["x"]}, 422),
    "beam search": (TEXT, {"model": MODEL, "prompt": "hi", "use_beam_search": True}, 400),
    "include_stop_str_in_output": (TEXT, {"model": MODEL, "prompt": "hi", "include_stop_str_in_output": True}, 400),
    "skip_special_tokens false": (CHAT, {"model": MODEL, "messages": MESSAGES, "skip_special_tokens": False}, 400),
    "json response format": (CHAT, {"model": MODEL, "messages": MESSAGES, "response_format": {"type": "json_object"}},
                             400),
    "audio output": (CHAT, {"model": MODEL, "messages": MESSAGES, "modalities": ["text", "audio"]}, 400),
    "tool_choice required": (CHAT, {"model": MODEL, "messages": MESSAGES, "tool_choice": "required"}, 400),
    "reasoning_effort": (CHAT, {"model": MODEL, "messages": MESSAGES, "reasoning_effort": "high"}, 400),
    "verbosity": (CHAT, {"model": MODEL, "messages": MESSAGES, "verbosity": "low"}, 400),
    "malformed JSON": (TEXT, '{"model": "tiny-chat", "prompt": ', 400),
    "not an object": (TEXT, "[1, 2]", 400),
    "body too large": (TEXT, {"model": MODEL, "prompt": "x" * 30_000}, 413),
    "no such route": ("/v1/embeddings", {"model": MODEL, "input": "hi"}, 404),
    "max_tokens far past the context": (TEXT, {"model": MODEL, "prompt": "hi", "max_tokens": 10**9}, 400),
    "max_tokens past the context": (CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": 127}, 400),
    "max_tokens a huge number": (TEXT, {"model": MODEL, "prompt": "hi", "max_tokens": 10**30}, 400),
    "stop_token_ids outside the vocabulary": (TEXT, {"model": MODEL, "prompt": "hi", "stop_token_ids": [10**12]}, 400),
    "top_k beyond the vocabulary": (TEXT, {"model": MODEL, "prompt": "hi", "top_k": 10**9}, 400),
    "top_k beyond the vocabulary, greedy": (TEXT, {"model": MODEL, "prompt": "hi", "temperature": 0,
                                                   "hispec": {"top_k": 10**9}}, 400),
    "more choices than one request may ask": (TEXT, {"model": MODEL, "prompt": ["a"] * 1000, "max_tokens": 2}, 400),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_an_openai_error(guarded, case):
    path, body, status = BAD[case]
    code, answer = guarded.request("POST", path, body)
    assert code == status, answer
    assert isinstance(answer, dict) and isinstance(answer["error"]["message"], str) and answer["error"]["type"]


def test_api_key(guarded):
    assert guarded.request("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
    code, answer = guarded.request("POST", TEXT, {"model": MODEL, "prompt": "hi"}, headers={"Authorization": ""})
    assert code == 401 and answer["error"]["code"] == "invalid_api_key"
    with pytest.raises(Exception) as err:
        OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert getattr(err.value, "status_code", None) == 401
    assert guarded.request("GET", "/health", headers={"Authorization": ""})[0] == 200  # not behind the key
    assert guarded.request("GET", "/v1/models")[0] == 200
    assert guarded.client().completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_unknown_fields_are_refused_by_name(guarded):
    body = {"model": MODEL, "prompt": "hi", "foo_bar": 1, "max_tokens": 2, "baz": None}
    code, answer = guarded.request("POST", TEXT, body)
    assert code == 400 and answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["param"] == "foo_bar"
    assert "foo_bar" in answer["error"]["message"] and "baz" in answer["error"]["message"]


def test_openai_client_fields_are_accepted(guarded):
    """Every field of OpenAI's request types that cannot change the output tokens is accepted at its
    neutral value (metadata, caching and routing hints, text-only formats)."""
    client = guarded.client()
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=3, temperature=0, top_p=1.0, n=1, seed=1, stop=None,
        user="u", metadata={"k": "v"}, store=False, service_tier="auto", parallel_tool_calls=False,
        response_format={"type": "text"}, modalities=["text"], prediction={"type": "content", "content": "hi"},
        prompt_cache_key="c", safety_identifier="s", frequency_penalty=0, presence_penalty=0, logit_bias={},
        logprobs=False, tool_choice="none", tools=[], reasoning_effort=None, verbosity=None)
    assert r.usage.completion_tokens == 3
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0, best_of=1, echo=False,
                                  frequency_penalty=0, presence_penalty=0, logit_bias={}, logprobs=None, n=1, seed=1,
                                  stop=[], suffix=None, top_p=1, user="u")
    assert r.usage.completion_tokens == 3


def test_full_queue_gets_503(long_base):
    """One running (max_num_seqs=1), one waiting (max_queue=1): the next request is refused, not queued."""
    model = HiSpecModel.from_pretrained(str(long_base))
    server = LiveServer(model, ServerConfig(MODEL, max_queue=1), num_blocks=600, max_num_seqs=1)
    try:
        body = {"model": MODEL, "prompt": "a", "max_tokens": 6000, "stream": True, "hispec": {"ignore_eos": True}}
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", TEXT, json.dumps(body), {"Content-Type": "application/json"})
        running = conn.getresponse()
        assert running.readline().startswith(b"data: ")  # seconds of work left: it holds the only place
        waiting = threading.Thread(target=server.request, args=("POST", TEXT, {"model": MODEL, "prompt": "b", "max_tokens": 2}))
        waiting.start()
        deadline = time.monotonic() + 10
        while server.metric("hispec_num_requests_waiting") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        code, answer = server.request("POST", TEXT, {"model": MODEL, "prompt": "c", "max_tokens": 2})
        assert code == 503 and answer["error"]["code"] == "queue_full"
        conn.sock.shutdown(socket.SHUT_RDWR)  # the running request leaves: the waiting one is served
        conn.close()
        waiting.join(30)
        assert not waiting.is_alive()
        assert server.request("POST", TEXT, {"model": MODEL, "prompt": "d", "max_tokens": 2})[0] == 200
    finally:
        server.close()


def test_port_in_use_fails_clearly(long_base):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "hispec_decode.tools.serve", "--base", str(long_base), "--heads",
                               "none", "--port", str(port), "--log-level", "warning"], capture_output=True, text=True,
                              timeout=120)
    assert proc.returncode == 2 and "port in use" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("argv, message", [(["--port", "70000"], "not a port"), (["--port", "-1"], "below 0"),
                                           (["--shutdown-timeout", "-5"], "finite number >= 0"),
                                           (["--shutdown-timeout", "nan"], "finite number >= 0")])
def test_serve_refuses_bad_options_before_loading(argv, message, capsys, monkeypatch):
    from hispec_decode import api
    from hispec_decode.tools import serve

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(api.HiSpecModel, "from_pretrained", no_loading)
    with pytest.raises(SystemExit) as info:
        serve.main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err
