"""The compiled decode kernels against the torch code they replace (hispec_decode/kernels/native.py):
the same bits where the kernel rounds where torch does, float32 sums within a last-bit tolerance,
and every row of the linear and attention kernels independent of the other rows of its call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hispec_decode import kernels
from hispec_decode.kernels import native
from hispec_decode.layers.linear import pack_vnni, vnni_group, vnni_linear

K = kernels.ops()
pytestmark = pytest.mark.skipif(K is None, reason="the compiled kernels are not available here")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_torch(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 576, generator=g) * 3).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    got, want = K.rms_norm(x, w, 1e-5), native.rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == want.shape
    # the float32 sum of squares may round differently; after that the same ops
    assert torch.allclose(got.float(), want.float(), rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-6)
    strided = torch.randn(3, 5, 960, generator=g).to(dtype)[..., 64:128]  # a head's slice of a qkv output
    assert torch.allclose(K.rms_norm(strided, w[:64], 1e-6).float(), native.rms_norm(strided, w[:64], 1e-6).float(),
                          rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm_matches_torch(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(7, 640, generator=g) * 3).to(dtype)
    scale = 1.0 + torch.randn(640, generator=g).to(dtype).float()
    got, want = K.gemma_rms_norm(x, scale, 1e-6), native.gemma_rms_norm(x, scale, 1e-6)
    assert got.dtype == dtype and got.shape == want.shape
    # float32 throughout and one rounding at the end: bf16 results differ where the sum of squares does
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-6)
    assert torch.allclose(got.float(), want.float(), **tol)
    if dtype == torch.bfloat16:
        assert (got != want).float().mean() < 0.01
    strided = torch.randn(2, 3, 4 * 256, generator=g).to(dtype).view(2, 3, 4, 256)[:, :, 1:3]  # q heads of a qkv view
    assert torch.allclose(K.gemma_rms_norm(strided, scale[:256], 1e-6).float(),
                          native.gemma_rms_norm(strided, scale[:256], 1e-6).float(), **tol)
    with pytest.raises(RuntimeError, match="float32 scale"):
        K.gemma_rms_norm(x, scale.double(), 1e-6)


def test_gemma_norm_scale_is_kept_while_the_weight_is_unchanged():
    from hispec_decode.models.gemma3 import _scale

    norm = torch.nn.Module()
    norm.weight = torch.nn.Parameter(torch.randn(16).to(torch.bfloat16), requires_grad=False)
    first = _scale(norm.weight, norm)
    assert _scale(norm.weight, norm) is first and torch.equal(first, 1.0 + norm.weight.float())
    with torch.no_grad():
        norm.weight.add_(1.0)  # an in-place update (an optimizer step, a load) bumps the version
    assert torch.equal(_scale(norm.weight, norm), 1.0 + norm.weight.float())
    norm.weight.requires_grad_(True)
    assert _scale(norm.weight, norm).requires_grad  # trainable: recomputed, in the autograd graph


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_matches_torch_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(1)
    T, H, Hk, d = 5, 9, 3, 64
    qkv = torch.randn(1, T, (H + 2 * Hk) * d, generator=g).to(dtype)
    q, k = qkv[..., : H * d].view(1, T, H, d), qkv[..., H * d : (H + Hk) * d].view(1, T, Hk, d)
    angle = torch.rand(T, d // 2, generator=g) * 6
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(dtype)[None, None]
    sin = torch.cat([angle.sin(), angle.sin()], -1).to(dtype)[None, None]
    (gq, gk), (wq, wk) = K.rope(q, k, cos, sin), native.rope(q, k, cos, sin)
    assert gq.shape == (1, H, T, d) and gk.shape == (1, Hk, T, d)
    assert torch.equal(gq, wq.contiguous()) and torch.equal(gk, wk.contiguous())


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype):
    x = (torch.randn(1, 6, 2 * 1536, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    got, want = K.silu_and_mul(x), native.silu_and_mul(x)
    assert got.shape == want.shape == (1, 6, 1536)
    # exp may differ from torch's in the last float32 bit, which bf16 rounding almost always hides
    assert torch.allclose(got.float(), want.float(), rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-6)


def _paged(dtype, kv_dtype, window=None, seed=3, tree=False):
    g = torch.Generator().manual_seed(seed)
    H, Hk, d, bs, blocks = 9, 3, 64, 16, 40
    keys = torch.randn(Hk, blocks * bs, d, generator=g).to(kv_dtype)
    values = torch.randn(Hk, blocks * bs, d, generator=g).to(kv_dtype)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:12] for _ in range(3)]).int()
    # rows: sequence 0 decodes one token at 37, sequence 1 verifies 4 at 100..103, sequence 2 at 5
    seq = torch.tensor([0, 1, 1, 1, 1, 2])
    length = torch.tensor([38, 101, 102, 103, 104, 6])
    tree_base, tree_mask = length.clone(), torch.zeros(len(seq), 4, dtype=torch.uint8)
    if tree:  # sequence 1's rows are a tree from slot 100: nodes 0 and 1 under the root, 2 under 0, 3 under 1
        tree_base[1:5] = 100
        tree_mask[1:5] = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.uint8)
    lo = length - window if window else torch.zeros_like(length)
    lo = lo.clamp(min=0)
    q = torch.randn(H, len(seq), d, generator=g).to(dtype)
    return q, keys, values, seq, length, lo, tree_base, tree_mask, tables, bs


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                            (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("tree", [False, True])
def test_paged_attention_matches_reference(dtype, kv_dtype, window, tree):
    args = _paged(dtype, kv_dtype, window, tree=tree)
    got = K.paged_attention(*args, 0.125)
    want = native.paged_attention(*args, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.dtype == dtype and torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


def test_paged_attention_tree_rows_see_their_ancestors_only():
    """A tree node's row equals the same query over the prefix and its ancestors laid out as a chain."""
    q, keys, values, seq, length, lo, tree_base, tree_mask, tables, bs = _paged(torch.float32, torch.float32, tree=True)
    got = K.paged_attention(q, keys, values, seq, length, lo, tree_base, tree_mask, tables, bs, 0.125)
    slot = lambda p: int(tables[1, p // bs]) * bs + p % bs
    for r, ancestors in ((3, [100, 102]), (4, [101, 103])):  # node 2 (row 3): root -> 0 -> 2; node 3: root -> 1 -> 3
        chain_k, chain_v = keys.clone(), values.clone()
        for i, a in enumerate(ancestors):  # the same entries moved to consecutive slots 100, 101
            chain_k[:, slot(100 + i)], chain_v[:, slot(100 + i)] = keys[:, slot(a)], values[:, slot(a)]
        alone = K.paged_attention(q[:, r : r + 1].contiguous(), chain_k, chain_v, seq[r : r + 1], torch.tensor([102]),
                                  lo[r : r + 1], torch.tensor([102]), tree_mask[r : r + 1], tables, bs, 0.125)
        assert torch.allclose(alone[0], got[r], atol=1e-6)


def test_paged_attention_rows_are_independent_of_the_call():
    for tree in (False, True):
        q, keys, values, seq, length, lo, tree_base, tree_mask, tables, bs = _paged(torch.bfloat16, torch.bfloat16, tree=tree)
        together = K.paged_attention(q, keys, values, seq, length, lo, tree_base, tree_mask, tables, bs, 0.125)
        for r in range(q.shape[1]):
            alone = K.paged_attention(q[:, r : r + 1].contiguous(), keys, values, seq[r : r + 1], length[r : r + 1],
                                      lo[r : r + 1], tree_base[r : r + 1], tree_mask[r : r + 1].contiguous(), tables,
                                      bs, 0.125)
            assert torch.equal(alone[0], together[r])


@pytest.mark.skipif(not kernels.has_linear_bf16(), reason="no AVX-512 BF16 here")
@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 12, 16, 21])  # every tile shape of both loops
@pytest.mark.parametrize("shape", [(960, 576), (40, 30), (8, 3)])  # K not a multiple of 32, N not of 16
def test_linear_bf16_matches_a_float32_product_and_is_row_independent(amx, rows, shape):
    if amx and not kernels.has_amx():
        pytest.skip("no AMX tiles here")
    g = torch.Generator().manual_seed(rows)
    n, k = shape
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    packed = pack_vnni(w, vnni_group(amx))
    got = vnni_linear(x, packed, bias, n, amx=amx)
    want = (x.float() @ w.float().t() + bias.float()).to(torch.bfloat16)
    assert got.shape == (rows, n)
    assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    alone = torch.cat([vnni_linear(x[i : i + 1], packed, bias, n, amx=amx) for i in range(rows)])
    assert torch.equal(alone, got)  # a row's bits never depend on the other rows of the call
    assert torch.allclose(got.float(), F.linear(x, w, bias).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not kernels.has_linear_bf16(), reason="no compiled bf16 linear here")
def test_linear_bf16_refuses_a_weight_of_another_layout_or_a_short_bias():
    k = kernels.ops()
    w = torch.randn(64, 64).to(torch.bfloat16)
    x = torch.randn(2, 64).to(torch.bfloat16)
    other = 2 if vnni_group(False) == 1 else 1
    with pytest.raises(RuntimeError, match="column block"):
        k.linear_bf16(x, pack_vnni(w, other), torch.empty(0))
    with pytest.raises(RuntimeError, match="one value per packed column"):
        k.linear_bf16(x, pack_vnni(w, vnni_group(False)), torch.zeros(63))


def test_pack_vnni_groups_hold_the_same_vectors():
    w = torch.randn(40, 30).to(torch.bfloat16)  # N, K not multiples of 32
    one, two = pack_vnni(w, 1), pack_vnni(w, 2)
    assert one.shape == (3, 16, 16, 2) and two.shape == (2, 16, 2, 16, 2)
    for block in range(3):  # block b of group 1 is slot b % 2 of group b // 2 in group 2
        assert torch.equal(one[block], two[block // 2, :, block % 2])
    assert torch.equal(one[:, :15].permute(0, 2, 1, 3).reshape(48, 30)[:40], w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_matches_torch_with_ties_and_nan(dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 49152, generator=g).to(dtype)
    x[1, 100] = x[1, 7] = x[1].max() + 1  # a tie: the first index wins
    x[2, 300] = float("nan")  # NaN counts as the largest, as in torch
    x[3] = 0.0
    x[4, -1] = float("inf")
    got = K.argmax_rows(x)
    assert got.tolist() == x.argmax(-1).tolist()
    assert got[1] == 7 and got[2] == 300 and got[3] == 0 and got[4] == 49151
    assert K.argmax_rows(x[0]).item() == x[0].argmax().item()


def test_a_build_lock_left_by_a_killed_build_is_removed(tmp_path):
    """torch's build lock outlives a killed build; a fresh one (a build running now) stays."""
    import os
    import time

    lock = tmp_path / "lock"
    lock.write_text("")
    kernels._clear_stale_lock(tmp_path)
    assert lock.exists()
    old = time.time() - kernels.STALE_LOCK_SECONDS - 5
    os.utime(lock, (old, old))
    kernels._clear_stale_lock(tmp_path)
    assert not lock.exists()
    kernels._clear_stale_lock(tmp_path)  # no lock: nothing to do


def test_a_lock_that_turns_stale_while_a_load_waits_is_removed(tmp_path):
    """A build killed less than STALE_LOCK_SECONDS ago: the next load waits on its lock, judges it again
    every second and removes it once stale, then loads (before: torch waited forever). Run in a child
    process (this one has loaded the kernels already), on a copy of the built kernels."""
    import os
    import shutil
    import subprocess
    import sys
    import time

    if kernels.ops() is None:
        pytest.skip("no compiled kernels here")
    copy = tmp_path / "kernels"
    shutil.copytree(kernels.build_directory(), copy, ignore=shutil.ignore_patterns("lock"))
    lock = copy / "lock"
    lock.write_text("")
    # made 2 s old just before the load: not stale then, stale 2 s later (STALE_LOCK_SECONDS = 4)
    code = ("import logging, os, time, hispec_decode.kernels as k; logging.basicConfig(); k.STALE_LOCK_SECONDS = 4; "
            f"t = time.time() - 2; os.utime({str(lock)!r}, (t, t)); print('loaded', k.ops() is not None)")
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, kernels.ENV_DIR: str(copy)},
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "loaded True" in out.stdout
    assert "waiting on another build's lock" in out.stderr and "removing a build lock" in out.stderr
    assert not lock.exists() and time.time() - t0 < 240


def test_the_lock_of_the_load_that_builds_is_its_own(tmp_path, monkeypatch, caplog):
    """The load that took the build lock (it compiles) neither warns that it waits on another build
    nor removes its own lock, however long the build takes (before: it said it waited on "another
    build" and would have removed its own lock after STALE_LOCK_SECONDS)."""
    import os
    import time

    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(kernels, "STALE_LOCK_SECONDS", 0)
    lock = tmp_path / "lock"
    with caplog.at_level("WARNING"), kernels._LockWatch(tmp_path) as watch:
        baton = cpp_extension.FileBaton(str(lock))  # as torch's load does
        assert baton.try_acquire() and watch.building
        os.utime(lock, (time.time() - 60, time.time() - 60))
        time.sleep(2.5)  # two rounds of the watch
        assert lock.exists() and not watch.cleared
        baton.release()
    assert cpp_extension.FileBaton is not type(baton)  # torch's own class is back
    assert "waiting on another build" not in caplog.text
    lock.write_text("")  # a lock somebody else holds is still judged
    os.utime(lock, (time.time() - 60, time.time() - 60))
    with kernels._LockWatch(tmp_path) as watch:
        time.sleep(1.5)
    assert watch.cleared and not lock.exists()


def test_a_build_whose_lock_another_load_removed_still_loads(tmp_path, caplog):
    """A build that outlived STALE_LOCK_SECONDS (a loaded machine) finds its lock removed by a load that
    waited on it: releasing it is not an error, so the build it finished is used, not the torch fallbacks."""
    import torch.utils.cpp_extension as cpp_extension

    lock = tmp_path / "lock"
    with caplog.at_level("WARNING"), kernels._LockWatch(tmp_path):
        baton = cpp_extension.FileBaton(str(lock))
        assert baton.try_acquire()
        lock.unlink()  # what the other load's _clear_stale_lock does
        baton.release()
    assert "removed as stale by another load" in caplog.text


def test_kernels_switched_off_say_so():
    import os
    import subprocess
    import sys

    code = "import logging, hispec_decode.kernels as k; logging.basicConfig(); print(k.ops())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, kernels.ENV_SWITCH: "0"},
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "None"
    assert "hispec kernels: off (HISPEC_KERNELS=0)" in out.stderr


def test_bf16_linears_without_the_kernels_run_where_onednn_lacks_bf16(monkeypatch):
    """An AVX2 CPU without the compiled kernels: oneDNN cannot pack bf16 there, so the fused linear
    multiplies the bf16 weight unpacked (it used to fail in oneDNN's reorder)."""
    from hispec_decode.layers import linear as linear_module

    monkeypatch.setattr(linear_module, "_mkldnn_bf16", lambda: False)
    lin = torch.nn.Linear(64, 48, dtype=torch.bfloat16)
    with kernels.disabled():
        fused = linear_module.FusedLinear([lin])
        x = torch.randn(3, 64, dtype=torch.bfloat16)
        assert not fused.packed and torch.equal(fused(x), F.linear(x, lin.weight, lin.bias))
