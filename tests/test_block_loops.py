"""The block kernel's two loops over interleaved (x8) weights give the same bits.

With VNNI (AVX512-VNNI with VL, or AVX-VNNI) the kernel adds products in int32 with vpdpbusd; without
it, in int16 first (vpmaddubsw) and then in int32. The integers are the same, so every output must be
too. The default build runs one loop; this test builds ``linear_q.cpp`` again with the other one forced
(``-DHISPEC_X8_INT32`` on a CPU without VNNI, where ``dot4`` stands in for vpdpbusd;
``-DHISPEC_X8_INT16`` on one with VNNI) and compares them on every format and row count.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hispec_decode import kernels
from hispec_decode.layers import quant
from hispec_decode.layers.quant import SERVED

from test_native import random_blocks

CSRC = Path(kernels.__file__).parent / "csrc"


@pytest.fixture(scope="module")
def other_loop(tmp_path_factory):
    """``linear_q`` built with the loop the default build does not use, and that loop's name."""
    from torch.utils.cpp_extension import load_inline

    if not quant.has_kernel():
        pytest.skip("the block kernels are not built here")
    default = kernels.block_linear_kind()
    define, kind = ("HISPEC_X8_INT16", "avx2") if default == "vnni" else ("HISPEC_X8_INT32", "int32")
    source = f'#define {define} 1\n#include "{CSRC / "linear_q.cpp"}"\n'
    module = load_inline(f"hispec_linear_q_{kind}", cpp_sources=[source], functions=["linear_q", "linear_q_kind"],
                         extra_cflags=["-O2", "-march=native", "-fopenmp", "-ffp-contract=off"],
                         extra_ldflags=["-fopenmp"], extra_include_paths=[str(CSRC)],
                         build_directory=str(tmp_path_factory.mktemp("linear_q")), verbose=False)
    assert module.linear_q_kind() == kind
    return module


@pytest.mark.parametrize("name", list(SERVED))
def test_the_int16_and_int32_loops_give_the_same_bits(other_loop, name):
    t = SERVED[name]
    rng = torch.Generator().manual_seed(t)
    for K in (256, 768):
        raw = random_blocks(t, 40, K, seed=K)
        blocks, packed_type = quant.pack(torch.from_numpy(np.ascontiguousarray(raw)), t)
        bias = torch.randn(40, generator=rng)
        x = torch.randn(11, K, generator=rng) * torch.logspace(-3, 2, K)[torch.randperm(K, generator=rng)]
        for rows in (1, 2, 3, 4, 5, 8, 9, 11):
            for xs in (x[:rows], x[:rows].bfloat16()):
                want = kernels.ops().linear_q(xs, blocks, packed_type, bias)
                got = other_loop.linear_q(xs, blocks, packed_type, bias)
                assert torch.equal(got, want), (name, K, rows, xs.dtype)
