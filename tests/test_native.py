"""GGUF block weights inside the kernels: the kernel against the ``gguf`` package's numpy
de-quantizers (the oracle), batch invariance, the torch fallback, and float checkpoints quantized on
load (every method equal to plain decoding of the same weights). Real GGUF bases: test_native_bases.py."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from hispec_decode import HiSpecModel, kernels
from hispec_decode.errors import HiSpecError
from hispec_decode.layers import quant
from hispec_decode.layers.quant import SERVED, BlockLinear, BlockWeight, quantize_q8

from conftest import ARCHS, identity_above, save_tiny, zero_head

gguf = pytest.importorskip("gguf")
needs_kernel = pytest.mark.skipif(not quant.has_kernel(), reason="the block kernels are not built here")
# the kernel and the float64 reference differ only in float32 rounding of the block sums
RELATIVE_TOLERANCE = 1e-5


def random_blocks(ggml_type: int, rows: int, columns: int, seed: int = 0) -> np.ndarray:
    """Random blocks of ``ggml_type`` with finite half-precision scales (every other byte random)."""
    rng = np.random.default_rng(seed)
    values, nbytes = quant.block_shape(ggml_type)
    raw = rng.integers(0, 256, size=(rows, columns // values, nbytes), dtype=np.uint8)
    offsets = {2: (0,), 6: (0,), 8: (0,), 3: (0, 2), 7: (0, 2), 12: (0, 2), 13: (0, 2), 14: (208,)}[ggml_type]
    for at in offsets:
        halves = rng.uniform(-0.05, 0.05, size=raw.shape[:2]).astype(np.float16)
        raw[:, :, at: at + 2] = halves.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def oracle(raw: np.ndarray, ggml_type: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type))))


@needs_kernel
@pytest.mark.parametrize("interleaved", [False, True], ids=["rows", "x8"])
@pytest.mark.parametrize("name", list(SERVED))
def test_kernel_equals_the_gguf_oracle(name, interleaved):
    t, K, N = SERVED[name], 512, 48
    raw = random_blocks(t, N, K)
    blocks, W = torch.from_numpy(raw), oracle(raw, t)
    if interleaved:
        blocks, t = quant.pack(blocks, t)
        assert t == SERVED[name] + quant.X8 and blocks.shape == raw.shape
    assert torch.equal(quant.dequantize(blocks, t, K), W)  # the file's values, bit for bit
    rows = torch.tensor([5, 0, 47, 5])
    assert torch.equal(quant.dequantize(blocks, t, K, rows), W[rows])
    x, bias = torch.randn(16, K), torch.randn(N)
    y = BlockWeight(blocks, t, bias)(x)
    reference = quantize_q8(x, quant.activation_group(t)).double() @ W.double().T + bias.double()
    assert ((y.double() - reference).abs().max() / reference.abs().max()).item() < RELATIVE_TOLERANCE
    # batch-invariant: each row alone, or among 11 (tiles of 8 and 3 rows, or 4, 4 and 3), gives the bits it
    # gives among 16
    for i in (0, 3, 9, 15):
        assert torch.equal(BlockWeight(blocks, t, bias)(x[i: i + 1])[0], y[i])
    assert torch.equal(BlockWeight(blocks, t, bias)(x[:11]), y[:11])
    # bf16 activations: the same float32 result, rounded once
    xb = x.bfloat16()
    assert torch.equal(BlockWeight(blocks, t, bias)(xb), BlockWeight(blocks, t, bias)(xb.float()).bfloat16())


@pytest.mark.parametrize("name", list(SERVED))
def test_interleaving_moves_bytes_and_selects_rows(name):
    t, K, N = SERVED[name], 256, 24
    raw = torch.from_numpy(random_blocks(t, N, K, seed=2))
    packed, kind = quant.pack(raw, t)
    assert kind == t + quant.X8 and not torch.equal(packed, raw)
    assert torch.equal(quant.unpack_rows(packed, kind), raw)
    rows = torch.tensor([23, 0, 9, 9])
    assert torch.equal(quant.unpack_rows(packed, kind, rows), raw[rows])
    twenty, kind20 = quant.pack(raw[:20], t)  # not a multiple of 8 rows: left row-major
    assert kind20 == t and torch.equal(twenty, raw[:20])
    linear = BlockLinear(packed, kind, K, torch.arange(N).float(), torch.float32)
    eight, five = linear.select(torch.arange(8, 16)), linear.select(torch.tensor([3, 1, 4, 1, 5]))
    assert eight.ggml_type == kind and five.ggml_type == t  # a multiple of 8 rows stays interleaved
    assert torch.equal(quant.unpack_rows(eight.blocks, eight.ggml_type), raw[8:16])
    assert torch.equal(five.blocks, raw[[3, 1, 4, 1, 5]]) and five.block_bias.tolist() == [3, 1, 4, 1, 5]
    with pytest.raises(ValueError, match="groups of 8 rows"):
        BlockLinear(raw[:12], kind, K)


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_torch_fallback_equals_the_oracle(name):
    t, K, N = SERVED[name], 256, 24
    raw = random_blocks(t, N, K, seed=1)
    x = torch.randn(5, K)
    with kernels.disabled():
        linear = BlockLinear(*quant.pack(torch.from_numpy(raw), t), K, None, torch.float32)
        y = linear(x)
        assert torch.equal(linear.weight, oracle(raw, t))
    reference = quantize_q8(x, quant.activation_group(t)).double() @ oracle(raw, t).double().T
    assert ((y.double() - reference).abs().max() / reference.abs().max()).item() < RELATIVE_TOLERANCE


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_activations_are_quantize_q8s(dtype):
    """A Q8_0 identity weight (scale 1) returns the kernel's 8-bit activations, de-quantized."""
    K = 64
    raw = np.zeros((K, K // 32, 34), dtype=np.uint8)
    raw[:, :, 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    for n in range(K):
        raw[n, n // 32, 2 + n % 32] = 1
    weight = BlockWeight(torch.from_numpy(raw.reshape(K, -1)), SERVED["Q8_0"])
    g = torch.Generator().manual_seed(0)
    for _ in range(50):  # bf16 values put products within an ulp of a tie often: the division must match
        x = (torch.randn(6, K, generator=g) * 3).to(dtype)
        x[0, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # ties once scaled by 127 / 127
        x[1] = 0
        assert torch.equal(weight(x.float()), quantize_q8(x, 32))


def test_activation_quantization_rounds_ties_to_even():
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5] + [0.0] * 28])
    assert quantize_q8(x, 32)[0, :4].tolist() == [127.0, 0.0, 2.0, -2.0]
    assert quantize_q8(torch.zeros(1, 32), 32).abs().sum() == 0


def test_block_linear_rejects_blocks_of_the_wrong_width():
    with pytest.raises(ValueError, match="Q4_K blocks for 512 inputs must be uint8"):
        BlockLinear(torch.zeros(4, 100, dtype=torch.uint8), SERVED["Q4_K"], 512)


def test_an_unserved_tensor_type_fails_before_any_work(tmp_path):
    from hispec_decode.models.native import prepare_native

    path = tmp_path / "q2k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    raw = np.zeros((4, 84), dtype=np.uint8)  # one Q2_K block per row
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_shape=(4, 84), raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(HiSpecError, match=r"tensor 'blk.0.attn_q.weight' as Q2_K, which the kernels do not serve"):
        prepare_native(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_native_needs_a_gguf_base(trainable_base):
    with pytest.raises(HiSpecError, match="dtype='native' decodes GGUF bases"):
        HiSpecModel.from_pretrained(str(trainable_base), dtype="native")


# -- a float checkpoint quantized on load -----------------------------------------------------------
@needs_kernel
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_on_load_every_method_equals_plain(tiny_models, arch):
    model = HiSpecModel.from_pretrained(str(tiny_models[arch].path), heads="none", dtype="q8_0")
    assert model.decoder.native and model.decoder.precision == "q8_0"
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, model.decoder.vocab_size, (n,), generator=g).tolist() for n in (5, 9)]
    plain = model.generate(ids, max_new_tokens=12, method="autoregressive").sequences
    n = model.num_layers
    for method, kwargs in [("self_spec", {"draft_layer": 1}),
                           ("hispec", {"draft_layer": 1, "verify_layer": max(2, n - 1), "window": 3,
                                       "batch_aware": False, "guard": False})]:
        assert model.generate(ids, max_new_tokens=12, method=method, **kwargs).sequences == plain, (arch, method)


def test_quantize_on_load_names_the_formats(trainable_base):
    with pytest.raises(HiSpecError, match="q8_0"):
        HiSpecModel.from_pretrained(str(trainable_base), dtype="q3_k")


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "opt"])
def test_quantized_exits_that_accept_everything(arch, tmp_path):
    """Zero blocks above layer 1 (zero weights quantize to zero): every draft is the final prediction."""
    tiny = save_tiny(arch, tmp_path / "base", mutate=identity_above(1))
    model = tiny.load(heads="none", dtype="q8_0")
    prompt = [3, 1, 4, 1, 5]
    plain = model.generate([prompt], max_new_tokens=16, method="autoregressive").sequences
    hi = model.generate([prompt], max_new_tokens=16, method="hispec", draft_layer=1, verify_layer=3, window=4,
                        num_draft=3, batch_aware=False, guard=False)
    assert hi.sequences == plain
    assert hi.stats["acceptance_intermediate"] == 1.0 and hi.stats["acceptance_final"] == 1.0


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_quantized_exits_that_reject_almost_everything(arch, tiny_models, tmp_path):
    from hispec_decode import ExitSpec, HiSpecAdapter

    base = tiny_models[arch].load(heads="none", dtype="q8_0")
    specs = [ExitSpec(1, "draft", "deep_context"), ExitSpec(3, "intermediate", "deep_context")]
    adapter = HiSpecAdapter.create(base.decoder, str(tiny_models[arch].path), specs)
    zero_head(adapter.head(1))
    adapter.save_pretrained(tmp_path / "heads")
    model = tiny_models[arch].load(heads=str(tmp_path / "heads"), dtype="q8_0")
    prompt = [3, 1, 4, 1, 5]
    plain = model.generate([prompt], max_new_tokens=16, method="autoregressive").sequences
    out = model.generate([prompt], max_new_tokens=16, method="hispec", window=4, num_draft=3, batch_aware=False,
                         guard=False)
    assert out.sequences == plain and out.stats["acceptance_intermediate"] <= 0.25


def test_q4_k_quantized_on_load_reads_back_through_the_oracle():
    from hispec_decode.models.quantize import quantize_q4_k

    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 512, generator=g)
    w[3] = 0  # an all-zero row: scales 0, values 0
    w[5, :32] += 4.0  # a sub-block far from the rest
    blocks = quantize_q4_k(w.numpy())
    assert blocks.dtype == np.uint8 and blocks.shape == (24, 512 // 256 * 144)
    back = oracle(blocks, SERVED["Q4_K"])
    assert torch.equal(back[3], torch.zeros(512))
    # each value within a half step of its sub-block's grid (d * sc) plus the 6-bit scales' rounding
    x = w.reshape(24, 2, 8, 32)
    spread = (x.amax(-1) - x.amin(-1).clamp(max=0)).repeat_interleave(32, -1).reshape(24, 512)
    assert ((back - w).abs() <= spread / 15 + 1e-3).all()
    assert ((back - w).abs().mean() / w.abs().mean()) < 0.12
    if quant.has_kernel():  # the kernel reads these blocks as a file's
        x = torch.randn(3, 512, generator=g)
        y = BlockWeight(torch.from_numpy(blocks), SERVED["Q4_K"])(x)
        reference = quantize_q8(x, 256).double() @ back.double().T
        assert ((y.double() - reference).abs().max() / reference.abs().max()).item() < RELATIVE_TOLERANCE
