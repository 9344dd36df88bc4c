"""The vocabulary level ``L_v`` (every layer, then the LM head over the base's most frequent tokens):
greedy output equals transformers' for every architecture with ``L_v`` drafting alone, below trained
exits and below an intermediate layer, with rankings that make it accept everything and nothing;
sampled output follows the base distribution at both stages; the ranking file is checked."""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import ARCHS, BATCH_PROMPTS, LAYERS, VOCAB, assert_first_two_tokens_follow, read_by
from conftest import LOSSLESS_NEW as NEW
from conftest import LOSSLESS_PROMPTS as PROMPTS
from hispec_decode import HiSpecModel
from hispec_decode.adapter.vocabulary import load_weights, ranking, save_weights, weights_from_tokens
from hispec_decode.decoding.policy import Policy
from hispec_decode.decoding.sampling import SamplingParams
from hispec_decode.errors import AdapterError, HiSpecError

# (method, draft_layer, verify_layer): L_v drafting alone; L_d -> L_v -> L_f; L_d -> L_i -> L_v -> L_f
HIERARCHIES = [("self_spec", LAYERS, None), ("hispec", LAYERS, None), ("hispec", 1, LAYERS), ("hispec", 2, 4)]


@contextlib.contextmanager
def ranked(model: HiSpecModel, order: torch.Tensor, own_tokens: bool = True):
    before, own_before = model.runner.ranking, model.runner.own_tokens
    model.runner.set_ranking(order)
    model.runner.own_tokens = own_tokens
    try:
        yield
    finally:
        model.runner.set_ranking(before)
        model.runner.own_tokens = own_before


def test_level_lists():
    p = Policy(draft_layer=2, verify_layer=4, window=3, num_draft=2, vocab=16, vocab_window=5)
    assert p.exits("hispec", 6) == (2, 4, 6, 6) and p.exits("self_spec", 6) == (2, 6) and p.exits("autoregressive", 6) == (6,)
    assert Policy(draft_layer=2, verify_layer=6, window=3, num_draft=2, vocab=16).exits("hispec", 6) == (2, 6, 6)
    # L_v drafts
    assert Policy(draft_layer=6, verify_layer=6, window=3, num_draft=2, vocab=16).exits("hispec", 6) == (6, 6)
    assert Policy(draft_layer=2, verify_layer=6, window=3, num_draft=2).exits("hispec", 6) == (2, 6)  # no middle level
    levels = p.levels("hispec", 6)
    assert [level.kind for level in levels] == ["exit", "exit", "vocab", "full"]
    assert [str(level) for level in levels] == ["L2", "L4", f"L_v({p.vocab})", "L_f"]
    assert [level.key for level in levels] == [2, 4, -p.vocab, 6]  # the two levels at layer 6 keep apart
    assert p.window_at(levels[1]) == 3 and p.window_at(levels[2]) == 5
    drafting = Policy(draft_layer=6, verify_layer=6, window=3, num_draft=2, vocab=16)
    assert [level.kind for level in drafting.levels("self_spec", 6)] == ["vocab", "full"]


def test_vocab_level_needs_a_ranking_and_valid_layers(hispec_models):
    model = hispec_models["llama"]
    with pytest.raises(HiSpecError, match="self_spec needs"):
        model.generate([[1, 2]], max_new_tokens=2, method="self_spec", draft_layer=LAYERS)  # L_v drafting, vocab off
    with pytest.raises(HiSpecError, match="vocab"):
        model.generate([[1, 2]], max_new_tokens=2, method="hispec", draft_layer=1, verify_layer=LAYERS, vocab=-1)
    with pytest.raises(HiSpecError, match="no tokenizer"):  # a tiny base: no tokenizer for a calibration decode
        model.generate([[1, 2]], max_new_tokens=2, method="hispec", draft_layer=1, verify_layer=LAYERS, vocab=8)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_vocab_level_equals_transformers(arch, hispec_models, references):
    model = hispec_models[arch]
    wanted = {t for n in PROMPTS for t in references[arch, n]}
    rest = [t for t in range(VOCAB) if t not in wanted]
    orders = {  # how L_v does: mixed, right on every reference token, never right
        "random": (torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1)), VOCAB // 2),
        "all": (torch.tensor(sorted(wanted) + rest), len(wanted)),
        "none": (torch.tensor(rest + sorted(wanted)), len(rest)),
    }
    for name, (order, size) in orders.items():  # without own tokens, "none" names no reference token at all
        with ranked(model, order, own_tokens=name == "random"):
            for method, draft_layer, verify_layer in HIERARCHIES:
                accepted = checked = 0
                for n, prompt in PROMPTS.items():
                    out = model.generate([prompt], max_new_tokens=NEW, **read_by(
                        method, draft_layer=draft_layer, verify_layer=verify_layer, window=3, num_draft=2, vocab=size,
                        vocab_window=3))
                    assert out.sequences[0] == references[arch, n], (name, method, draft_layer, verify_layer, n)
                    if draft_layer == LAYERS:  # L_v's drafts, checked by the full head
                        top = out.stats["levels"][-1]
                        assert top["level"] == "L_f"
                        accepted += top["accepted"]
                        checked += top["checked"]
                if draft_layer == LAYERS and name != "random":
                    assert checked > 0
                    assert accepted == (checked if name == "all" else 0), (name, method, accepted, checked)


@pytest.mark.parametrize("arch", ARCHS)
def test_vocab_level_names_the_sequence_own_tokens(arch, hispec_models, references):
    """With a vocabulary that holds none of the reference tokens, L_v still names the ones its sequence has
    committed: drafting, it proposes them and the full model accepts some; output equals transformers' both ways."""
    model = hispec_models[arch]
    wanted = {t for n in PROMPTS for t in references[arch, n]}
    rest = [t for t in range(VOCAB) if t not in wanted]
    got = {}
    for own in (False, True):
        with ranked(model, torch.tensor(rest + sorted(wanted)), own_tokens=own):
            accepted = 0
            for n, prompt in PROMPTS.items():
                out = model.generate([prompt], max_new_tokens=NEW, method="self_spec", draft_layer=LAYERS, num_draft=2,
                                     vocab=len(rest))
                assert out.sequences[0] == references[arch, n], (own, n)
                accepted += out.stats["levels"][-1]["accepted"]
            got[own] = accepted
    assert got[False] == 0 and got[True] > 0, got


def test_own_tokens_are_committed_tokens_outside_the_level(hispec_models):
    """L_v's logits for a sequence: the full LM head's on its level's tokens and on its committed tokens outside
    them, -inf elsewhere; a tentative token (a draft being judged) is never named."""
    from hispec_decode.engine.own_tokens import OwnTokens, add_own_logits

    model = hispec_models["llama"]
    runner, decoder = model.runner, model.decoder
    with ranked(model, torch.arange(VOCAB)):
        size = 50
        inside = runner.level_mask(size)
        tokens = [3, 60, 7, 60, 75, 90]  # 60 and 75 committed outside the level; 90 tentative
        own = OwnTokens(size=size)
        own.update(tokens, 5, inside, decoder.lm_head)
        assert own.ids == [60, 75] and own.scanned == 5
        h = decoder.exit_norm(torch.randn(1, 3, decoder.config.hidden_size, generator=torch.Generator().manual_seed(0)))
        logits = decoder.vocab_logits(h, runner.level_vocab(size))[0]
        add_own_logits(logits, h[0], own)
        full = decoder.lm_logits(h)[0].float()
        named = inside.clone()
        named[[60, 75]] = True
        torch.testing.assert_close(logits[:, named].float(), full[:, named], rtol=1e-4, atol=1e-4)
        assert torch.isinf(logits[:, ~named]).all() and not named[90]
        own.update(tokens, 6, inside, decoder.lm_head)  # 90 committed now
        assert own.ids == [60, 75, 90]


@pytest.mark.parametrize("arch", ["llama", "gemma3", "opt"])
def test_batched_vocab_level_with_preemption(arch, hispec_models, tiny_models):
    model = hispec_models[arch]
    want = [tiny_models[arch].hf_generate(p, NEW) for p in BATCH_PROMPTS]
    with ranked(model, torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))):
        for method, draft_layer, verify_layer in HIERARCHIES[1:]:
            out = model.generate(BATCH_PROMPTS, max_new_tokens=NEW, method=method, draft_layer=draft_layer,
                                 verify_layer=verify_layer, vocab=VOCAB // 2, num_blocks=12, block_size=4)
            assert out.sequences == want, (method, draft_layer, verify_layer)
            assert out.stats["preemptions"] > 0, "no preemption: this test tests nothing"


@pytest.mark.parametrize("hierarchy", [("hispec", 4, None), ("hispec", 1, 4), ("hispec", 1, 2)])
def test_samples_with_vocab_level_follow_base_distribution(small_vocab_model, hierarchy):
    """L_v's proposal is its restricted, renormalized distribution (its 5 tokens and the sequence's own committed
    ones): the chi-square test of the sampling tests (3000 draws) with L_v drafting (checked by L_f) and
    checking L_d's drafts (then L_f checks L_v)."""
    path, reference = small_vocab_model
    model = HiSpecModel.from_pretrained(str(path))
    model.runner.set_ranking(torch.tensor([5, 2, 7, 0, 1, 3, 4, 6]))
    assert not model.runner.level_mask(5)[[3, 4]].any()  # the prompt's 3 and 4: L_v names them as its own tokens
    method, draft_layer, verify_layer = hierarchy
    params = SamplingParams(do_sample=True, temperature=0.9)
    out = model.generate([[3, 1, 4]] * 3000, max_new_tokens=2, method=method, do_sample=True, temperature=0.9, seed=7,
                         draft_layer=draft_layer, verify_layer=verify_layer, window=2, num_draft=2, vocab=5,
                         vocab_window=2)
    assert out.stats["levels"][-1]["checked"] > 0
    assert_first_two_tokens_follow(out.sequences, reference, params)


def test_ranking_file_round_trip_and_errors(tmp_path):
    weights = weights_from_tokens([[3, 3, 5], [5, 5, 1]], 8)
    assert weights.tolist() == [0, 1, 0, 2, 0, 3, 0, 0]
    assert ranking(weights)[:3].tolist() == [5, 3, 1] and ranking(weights)[3:].tolist() == [0, 2, 4, 6, 7]
    path = save_weights(tmp_path, weights, {"source": "test"})
    assert torch.equal(load_weights(path, 8), weights)
    with pytest.raises(AdapterError, match="base has 9"):
        load_weights(path, 9)
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(AdapterError, match="not a readable"):
        load_weights(path, 8)


def test_calibration_ranking_for_a_base_without_one(tmp_path, monkeypatch, tiny_models):
    """A base whose adapter ships no ranking gets one from a short calibration decode, kept under
    $HISPEC_HOME and read back next time."""
    from transformers import AutoTokenizer

    from conftest import save_char_tokenizer

    monkeypatch.setenv("HISPEC_HOME", str(tmp_path / "home"))
    save_char_tokenizer(tmp_path / "tok")
    model = tiny_models["llama"].load()
    model.tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tok")
    first = model.token_ranking()
    assert sorted(first.tolist()) == list(range(VOCAB))
    kept = list((tmp_path / "home" / "vocab").glob("*.safetensors"))
    assert len(kept) == 1
    again = tiny_models["llama"].load()
    assert again.tokenizer is None  # read back: no decode needed
    assert torch.equal(again.token_ranking(), first)
    out = again.generate([[1, 2, 3]], max_new_tokens=NEW, method="self_spec", draft_layer=LAYERS, vocab=VOCAB // 2)
    assert out.sequences[0] == tiny_models["llama"].hf_generate([1, 2, 3], NEW)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "opt"])
def test_bf16_batch_invariant_vocab_level_equals_own_autoregressive(arch, tiny_models):
    """The batch-invariant mode keeps its guarantee with L_v: in bf16, every hierarchy with the
    vocabulary level (and prompt lookup's union tree) gives this engine's own autoregressive output, at
    batch 1 and beside other sequences."""
    model = tiny_models[arch].load(dtype="bfloat16", batch_invariant=True)
    model.runner.set_ranking(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3)))
    prompts = list(PROMPTS.values())[:4]
    alone = [model.generate([p], max_new_tokens=NEW, method="autoregressive").sequences[0] for p in prompts]
    checked = 0
    for method, draft_layer, verify_layer in HIERARCHIES:
        for extra in ({}, {"lookup": 4, "drafting": "union"}):
            for b in (1, 3):
                out = model.generate(prompts[:b], max_new_tokens=NEW, **read_by(
                    method, draft_layer=draft_layer, verify_layer=verify_layer, vocab=VOCAB // 2, vocab_window=3,
                    num_draft=2, guard=False, batch_aware=False, **extra))
                assert out.sequences == alone[:b], (method, draft_layer, verify_layer, extra, b)
                checked += out.stats["levels"][-1]["checked"]
    assert checked > 0


@pytest.mark.parametrize("method,draft_layer,verify_layer", HIERARCHIES)
def test_drafter_invariant_samples_with_vocab_level_are_the_same_text(method, draft_layer, verify_layer, hispec_models):
    """Drafter-invariant sampling keeps its guarantee with L_v: the seeded sample of every hierarchy with
    the vocabulary level is the autoregressive one, alone and in a batch."""
    model = hispec_models["llama"]
    kwargs = dict(max_new_tokens=NEW, do_sample=True, temperature=0.9, seed=5, drafter_invariant=True)
    prompts = BATCH_PROMPTS[:3]
    alone = [model.generate([p], method="autoregressive", **(kwargs | {"seed": 5 + i})).sequences[0]
             for i, p in enumerate(prompts)]
    with ranked(model, torch.randperm(VOCAB, generator=torch.Generator().manual_seed(4))):
        for b in (1, 3):
            out = model.generate(prompts[:b], **read_by(method, draft_layer=draft_layer, verify_layer=verify_layer,
                                                         vocab=VOCAB // 2, vocab_window=3, num_draft=2), **kwargs)
            assert out.sequences == alone[:b], b
            assert out.stats["levels"][-1]["checked"] > 0
