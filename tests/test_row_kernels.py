"""The row-invariant CPU kernels: close to float64 math, and a row's bits independent of the rows beside it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddtree.runtime import invariant
from ddtree.targets import native, row_kernels

pytestmark = pytest.mark.skipif(not native.available(), reason=f"kernels: {native.unavailable_reason()}")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.fixture(autouse=True, params=["native", "avx2"])
def build(request, monkeypatch):
    """Every test on both builds: this CPU's widest vectors (AVX-512 and AVX512-BF16 here, where it has them)
    and the portable AVX2 one."""
    monkeypatch.setenv("DDTREE_KERNEL_ARCH", request.param)
    native.library.cache_clear()
    yield request.param
    monkeypatch.undo()
    native.library.cache_clear()
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float64: 1e-12}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("n,k", [(97, 70), (64, 64), (3, 9)])
def test_linear_is_close_to_float64_and_row_invariant(dtype, transposed, n, k):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(23, k, generator=g).to(dtype)
    weight = w.t().contiguous() if transposed else w
    y = row_kernels.linear(x, weight, b, transposed=transposed)
    want = F.linear(x.double(), w.double(), b.double())
    assert y.dtype == dtype
    assert (y.double() - want).abs().max() <= TOLERANCE[dtype] * (1 + want.abs().max())
    for rows in (slice(0, 1), slice(5, 6), slice(3, 7), slice(0, 23)):  # the same bits in any company
        assert torch.equal(row_kernels.linear(x[rows], weight, b, transposed=transposed), y[rows])


def _reference(q, k, v, start, visible, scale, sinks=None, softcap=None):
    bsz, hq, n, d = q.shape
    hkv, prefix = k.shape[1], k.shape[2] - n
    out = torch.zeros(bsz, n, hq, d, dtype=torch.float64)
    for b in range(bsz):
        for i in range(n):
            cols = list(range(int(start[b, i]), prefix)) + [prefix + m for m in range(n) if visible[b, i, m]]
            for h in range(hq):
                kk, vv = k[b, h // (hq // hkv), cols].double(), v[b, h // (hq // hkv), cols].double()
                s = kk @ q[b, h, i].double() * scale
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                p = (torch.cat([s, sinks[h:h + 1].double()]).softmax(0)[:-1] if sinks is not None else s.softmax(0))
                out[b, i, h] = p @ vv
    return out


PARENTS = [-1, 0, 0, 1, 2, 3, 3, 4, 5, 8, 9, 1]
CHAIN = [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # a causal prefill's tokens: every node's keys one run of columns
MIXED = [-1, 0, 1, 2, 3, 4, 5, 6, 3, 8, 2, 10]  # the first 8 nodes (one task's chunk) a chain, the rest branch
PADDED = "padded"  # a left-padded prompt's chain: 3 pad nodes, each seeing itself, then tokens that see no pad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sinks,softcap", [(False, None), (True, None), (False, 5.0)])
@pytest.mark.parametrize("d,prefix", [(24, 13), (64, 37), (128, 21), (64, 0)])  # 64, 128: the register passes
@pytest.mark.parametrize("parents", [PARENTS, CHAIN, MIXED, PADDED], ids=["tree", "chain", "mixed", "padded"])
def test_tree_attention_is_close_to_float64_and_each_node_is_a_one_token_step(dtype, sinks, softcap, d, prefix,
                                                                               parents):
    """Alone, a node's ancestors are prefix keys, in the tree its own: both must give the same bits."""
    g = torch.Generator().manual_seed(1)
    bsz, hq, hkv, n = 2, 6, 2, len(CHAIN)
    visible = torch.zeros(bsz, n, n, dtype=torch.bool)
    for i in range(n):
        m = i
        while m >= 0:
            visible[:, i, m] = parents != PADDED or m >= 3 or m == i
            m = (CHAIN if parents == PADDED else parents)[m]
    q = torch.randn(bsz, hq, n, d, generator=g).to(dtype)
    k = torch.randn(bsz, hkv, prefix + n, d, generator=g).to(dtype)
    v = torch.randn(bsz, hkv, prefix + n, d, generator=g).to(dtype)
    start = torch.tensor([[0] * n, [3, 4, 5, 3, 3, 6, 7, 8, 2, 3, 4, 12]]).clamp(max=prefix)  # row 1: padding, a window
    sink = torch.randn(hq, generator=g) if sinks else None
    out = row_kernels.tree_attention(q, k, v, start, visible, scale=0.3, sinks=sink, softcap=softcap)
    want = _reference(q, k, v, start, visible, 0.3, sink, softcap)
    assert (out.double() - want).abs().max() <= TOLERANCE[dtype] * 10
    for b in range(bsz):
        for i in range(n):  # node i alone, its path as the last keys: a one-token step at its position
            cols = list(range(prefix)) + [prefix + m for m in range(n) if visible[b, i, m]]
            step = row_kernels.tree_attention(q[b:b + 1, :, i:i + 1], k[b:b + 1, :, cols], v[b:b + 1, :, cols],
                                              start[b:b + 1, i:i + 1], torch.ones(1, 1, 1, dtype=torch.bool),
                                              scale=0.3, sinks=sink, softcap=softcap)
            assert torch.equal(step[0, 0], out[b, i]), (b, i)


def test_elementwise_sends_every_element_through_the_same_code():
    """A 4-wide gate tensor: torch's scalar tail would give some rows other bits than alone; padded, none."""
    torch.set_num_threads(1)
    x = torch.randn(2, 11, 4, generator=torch.Generator().manual_seed(0)) * 3
    for fn in (torch.sigmoid, F.softplus, F.silu):
        whole = invariant.elementwise(fn, x)
        torch.testing.assert_close(whole, fn(x))
        for b in range(2):
            for i in range(11):
                assert torch.equal(invariant.elementwise(fn, x[b:b + 1, i:i + 1]), whole[b:b + 1, i:i + 1])
    plain = F.softplus(x)
    assert any(not torch.equal(F.softplus(x[b:b + 1, i:i + 1]), plain[b:b + 1, i:i + 1])
               for b in range(2) for i in range(11))  # the control: torch alone does depend on the company


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="input has 5 features but the weight"):
        row_kernels.linear(torch.randn(2, 5), torch.randn(3, 4))
    with pytest.raises(ValueError, match="one dtype among float32, bfloat16"):
        row_kernels.linear(torch.randn(2, 4), torch.randn(3, 4).double())
    with pytest.raises(ValueError, match="start must be"):
        row_kernels.tree_attention(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8),
                                   torch.zeros(1, 2), torch.ones(1, 3, 3, dtype=torch.bool), scale=1.0)
