"""Batched decoding on the paged cache: every row equals that prompt decoded alone, token for token."""

from __future__ import annotations

import pytest
import torch

from hispec_decode import HiSpecAdapter
from hispec_decode.adapter import ExitSpec
from hispec_decode import OutOfBlocksError

from conftest import ARCHS, save_tiny
from conftest import BATCH_PROMPTS as PROMPTS
from conftest import identity_above, read_by

NEW = 16
METHODS = ["autoregressive", "self_spec", "hispec"]
POLICY = dict(draft_layer=2, verify_layer=4, window=3, num_draft=2)


def _kwargs(method: str) -> dict:
    return read_by(method, **POLICY)


@pytest.fixture(scope="module")
def alone(hispec_models):
    """Each prompt decoded on its own (batch of one) by each method."""
    out = {}
    for arch in ARCHS:
        for method in METHODS:
            out[arch, method] = [hispec_models[arch].generate([p], max_new_tokens=NEW, **_kwargs(method)).sequences[0]
                                 for p in PROMPTS]
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", METHODS)
def test_batched_rows_equal_rows_decoded_alone(arch, method, hispec_models, tiny_models, alone):
    model = hispec_models[arch]
    for b in (1, 2, 5, 16):
        out = model.generate(PROMPTS[:b], max_new_tokens=NEW, **_kwargs(method))
        assert out.sequences == alone[arch, method][:b], b
        assert out.stats["preemptions"] == 0
    # and alone equals transformers (spot check: the longest and the shortest prompt)
    for i in (0, 5):
        assert alone[arch, method][i] == tiny_models[arch].hf_generate(PROMPTS[i], NEW)


def _repeat_last_token(model) -> None:
    """Every layer becomes the identity and the LM head the embedding matrix: the model repeats
    its last input token forever, and every exit (without heads) predicts exactly that."""
    identity_above(0)(model)
    emb = model.get_input_embeddings().weight
    emb.copy_(torch.randn_like(emb) * 3)
    out = model.get_output_embeddings().weight
    if out.data_ptr() != emb.data_ptr():
        out.copy_(emb)
    decoder = getattr(model.model, "decoder", None)  # OPT: no positions, project_in/out inverse
    if decoder is not None:
        decoder.embed_positions.weight.zero_()
        if decoder.project_in is not None:
            q, _ = torch.linalg.qr(torch.randn(decoder.project_in.weight.shape))
            decoder.project_in.weight.copy_(q)
            decoder.project_out.weight.copy_(q.T)


@pytest.mark.parametrize("arch", ARCHS)
def test_rows_that_accept_everything_beside_rows_that_reject_everything(arch, tmp_path):
    """The draft head maps every hidden state to zero, so it always proposes token 0; the model
    repeats the last prompt token. Rows ending in 0 accept every draft, the others none."""
    tiny = save_tiny(arch, tmp_path / "base", mutate=_repeat_last_token)
    model = tiny.load()
    adapter = HiSpecAdapter.create(model.decoder, str(tiny.path), [ExitSpec(2, "draft", "residual_linear")])
    with torch.no_grad():
        adapter.head(2).proj.weight.copy_(-torch.eye(adapter.head(2).proj.weight.shape[0]))
    adapter.save_pretrained(tmp_path / "heads")
    model = tiny.load(heads=str(tmp_path / "heads"))
    rows = [[5, 0], [3, 9], [1, 2, 3, 0], [7], [0], [4, 4, 8]]
    for method in ("self_spec", "hispec"):
        out = model.generate(rows, max_new_tokens=NEW, **_kwargs(method))
        for row, seq, run in zip(rows, out.sequences, out.seqs):
            assert seq == [row[-1]] * NEW == tiny.hf_generate(row, NEW)
            c = run.counters
            rate = c.accepted_intermediate / c.drafted if method == "hispec" else c.accepted_final / c.tentative
            assert rate == (1.0 if row[-1] == 0 else 0.0), (method, row, c)


@pytest.mark.parametrize("method", METHODS)
def test_small_cache_preempts_and_recomputes_without_changing_a_token(method, hispec_models, alone):
    model = hispec_models["qwen3"]
    for schedule in ("eager", "gather"):
        out = model.generate(PROMPTS[:8], max_new_tokens=NEW, num_blocks=14, block_size=4, schedule=schedule,
                             **_kwargs(method))
        assert out.sequences == alone["qwen3", method][:8]
        assert out.stats["preemptions"] > 0


def test_preemption_keeps_sampled_output_too(hispec_models):
    """The sampler is rewound to the last commit: a small cache draws the same samples."""
    model = hispec_models["llama"]
    kw = dict(max_new_tokens=NEW, method="hispec", do_sample=True, temperature=0.9, seed=3, **POLICY)
    roomy = model.generate(PROMPTS[:8], **kw)
    tight = model.generate(PROMPTS[:8], num_blocks=14, block_size=4, **kw)
    assert tight.stats["preemptions"] > 0 and tight.sequences == roomy.sequences


def test_cache_that_cannot_hold_one_sequence_fails_clearly(hispec_models):
    model = hispec_models["llama"]
    with pytest.raises(OutOfBlocksError, match="cannot fit a KV cache of 3 blocks"):
        model.generate([PROMPTS[5]], max_new_tokens=40, num_blocks=3, block_size=8)
    server = model.build_engine(method="hispec", num_blocks=4, block_size=8)
    server.add_request(PROMPTS[0], max_new_tokens=8)
    with pytest.raises(OutOfBlocksError, match="raise num_blocks"):  # refused up front; the queue is untouched
        server.add_request(PROMPTS[5], max_new_tokens=20)
    assert len(server.scheduler.waiting) == 1


@pytest.mark.parametrize("method", METHODS)
def test_gather_schedule_gives_the_same_tokens_as_alone(method, hispec_models, alone):
    out = hispec_models["opt"].generate(PROMPTS, max_new_tokens=NEW, schedule="gather", **_kwargs(method))
    assert out.sequences == alone["opt", method]


def test_continuous_batching_streams_and_frees_blocks(hispec_models, alone):
    model = hispec_models["llama"]
    server = model.build_engine(method="hispec", num_blocks=64, block_size=4, **POLICY)
    ids = [server.add_request(p, max_new_tokens=NEW) for p in PROMPTS[:3]]
    streamed: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    finished = []
    for step in range(200):
        if step == 5:  # requests join a running batch
            ids += [server.add_request(p, max_new_tokens=NEW) for p in PROMPTS[3:8]]
        for o in server.step():
            assert not finished.count(o.request_id), "no tokens after a request finished"
            streamed[o.request_id] += o.new_tokens
            if o.finished:
                finished.append(o.request_id)
                assert o.request_id not in server.cache.manager.seqs, "a finished request's blocks are freed at once"
        server.cache.manager.check()
        if not server.has_unfinished():
            break
    assert sorted(finished) == ids
    assert [streamed[i] for i in ids] == alone["llama", "hispec"][:8]
    assert server.cache.manager.num_free == 64


def test_sampled_batch_rows_follow_their_own_seeds(hispec_models):
    """Row i samples with seed + i, whatever else is in the batch."""
    model = hispec_models["qwen2"]
    kw = dict(max_new_tokens=NEW, do_sample=True, temperature=0.8, method="hispec", **POLICY)
    batch = model.generate(PROMPTS[:4], seed=10, **kw).sequences
    assert batch == [model.generate([p], seed=10 + i, **kw).sequences[0] for i, p in enumerate(PROMPTS[:4])]


def test_gather_policy_does_not_starve_verification_under_steady_arrivals(hispec_models, alone):
    model = hispec_models["llama"]
    server = model.build_engine(method="hispec", num_blocks=256, block_size=4, schedule="gather", **POLICY)
    first = server.add_request(PROMPTS[0], max_new_tokens=NEW)
    committed: list[int] = []
    for step in range(40):
        server.add_request(PROMPTS[1 + step % 15], max_new_tokens=4)  # a new drafter every step
        for o in server.step():
            if o.request_id == first:
                committed += o.new_tokens
    # without the wait cap nothing would ever be verified while drafters keep arriving
    assert len(committed) >= 3 and committed == alone["llama", "hispec"][0][: len(committed)]


@pytest.mark.parametrize("method", METHODS)
def test_max_num_seqs_caps_the_running_batch(method, hispec_models, alone):
    model = hispec_models["llama"]
    server = model.build_engine(max_new_tokens=NEW, max_num_seqs=3, **_kwargs(method))
    ids = [server.add_request(p) for p in PROMPTS[:8]]
    most = 0
    while server.has_unfinished():
        server.step()
        most = max(most, len(server.scheduler.running))
    assert most == 3
    assert [server.release(i).new_tokens for i in ids] == alone["llama", method][:8]
    assert not server.sequences and server.cache.manager.num_free == server.cache.manager.num_blocks


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", METHODS)
def test_chunked_prefill_gives_the_same_tokens(arch, method, hispec_models, alone):
    """Prompts prefilled a few tokens per step (beside rows that decode) change no token."""
    out = hispec_models[arch].generate(PROMPTS, max_new_tokens=NEW, prefill_chunk=3, **_kwargs(method))
    assert out.sequences == alone[arch, method]


def test_chunked_prefill_spreads_a_prompt_over_steps_without_holding_decode_rows(hispec_models):
    engine = hispec_models["llama"].build_engine(method="autoregressive", max_new_tokens=30, num_blocks=64, prefill_chunk=4)
    first = engine.add_request(PROMPTS[0])  # one token: no chunks
    engine.step()
    assert engine.sequences[first].committed == 2
    second = engine.add_request(PROMPTS[5])  # 20 tokens: 5 steps of 4, the last one by its own request
    for step in range(5):
        engine.step()
        assert engine.sequences[first].committed == 3 + step, "a decode row waited for a prefill"
        assert engine.sequences[second].processed(0) == min(4 * (step + 1), 20)
        assert engine.sequences[second].committed == 20 + (step == 4)
    with pytest.raises(Exception, match="prefill_chunk"):
        hispec_models["llama"].build_engine(prefill_chunk=0)
