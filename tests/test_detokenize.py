"""Streamed text: deltas add up to the full decode, stop strings cut it, nothing past a stop leaks."""

from __future__ import annotations

import pytest

from conftest import save_char_tokenizer
from hispec_decode.serving.detokenize import TextStream


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
    from tokenizers import decoders
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chartok")
    save_char_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.backend_tokenizer.decoder = decoders.Fuse()  # characters joined without spaces
    return tok


def stream_all(tokenizer, ids, stop=None, chunk=1):
    s = TextStream(tokenizer, stop)
    deltas = [s.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(s.finish())
    return s, deltas


@pytest.mark.parametrize("chunk", [1, 3])
def test_stop_strings_cut_before_the_first_one(char_tokenizer, chunk):
    text = "hello world. stop here! more text STOP"
    ids = char_tokenizer(text)["input_ids"]
    s, deltas = stream_all(char_tokenizer, ids, ["here!", "more"], chunk)
    assert "".join(deltas) == "hello world. stop " and s.stopped
    assert s.num_tokens == len(char_tokenizer("hello world. stop here!")["input_ids"])  # up to the stop's last token
    emitted = ""
    for d in deltas:  # no delta ever showed text the stop string later removed
        emitted += d
        assert "hello world. stop ".startswith(emitted)


def test_no_stop_returns_everything(char_tokenizer):
    ids = char_tokenizer("abc def")["input_ids"]
    s, deltas = stream_all(char_tokenizer, ids)
    assert "".join(deltas) == "abc def" and not s.stopped and s.num_tokens == len(ids)
    assert all(d for d in deltas[:-1])  # without stop strings nothing is held back


@pytest.mark.slow
def test_multibyte_text_streams_whole_characters():
    from transformers import AutoTokenizer

    from hispec_decode.models.loading import default_base_dir

    tok = AutoTokenizer.from_pretrained(default_base_dir())
    text = "Zürich → 東京 naïve café 🙂👍🏽 done"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some tokens are partial characters
    s, deltas = stream_all(tok, ids)
    assert "".join(deltas) == tok.decode(ids) and all("\ufffd" not in d for d in deltas)
    s, deltas = stream_all(tok, ids, ["café"])
    assert "".join(deltas) == tok.decode(ids).split("café")[0]
