"""Split prefix/tree attention: exactness against the dense mask, the HF registration, the drafter's block attention."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from ddtree.core.masks import tree_attention_mask
from ddtree.core.tree import DraftTree
from ddtree.drafters.dflash.attention import block_attention
from ddtree.targets.backends import (
    CPU_DENSE_BELOW,
    CUDA_DENSE_BELOW,
    AutoBackend,
    DenseMaskBackend,
    SplitBackend,
    auto_backend_name,
    get_backend,
)
from ddtree.targets.cache import cache_kwargs
from ddtree.targets.kernels import (
    causal_attention,
    flash_attn_available,
    fused_block_kernel,
    fused_prefix_kernel,
)
from ddtree.targets.registration import TREE_KWARG, register_attention_implementations
from ddtree.targets.split_attention import (
    attention_with_lse,
    merge_attention,
    split_tree_attention,
    torch_prefix_kernel,
)

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


KERNELS = {"torch": (torch_prefix_kernel(chunk=512), None), "fused": (fused_prefix_kernel, fused_block_kernel)}


def random_tree(n: int, rng: random.Random, batch: int = 1, max_depth: int | None = None) -> DraftTree:
    """Random parent pointers (bushy or deep, by a random bias), parents before children."""
    rows = []
    for _ in range(batch):
        parents, depths = [-1], [0]
        deep = rng.random()
        for i in range(1, n):
            while True:
                p = i - 1 if rng.random() < deep else rng.randrange(i)
                if max_depth is None or depths[p] < max_depth:
                    break
            parents.append(p)
            depths.append(depths[p] + 1)
        rows.append(parents)
    return DraftTree.from_parents(torch.zeros(batch, n, dtype=torch.long), torch.tensor(rows))


def dense_reference(q, k, v, tree: DraftTree, prefix_len: int, window: int | None) -> torch.Tensor:
    """Softmax over ``[prefix | tree]`` with the lead's dense additive mask, written out in q's dtype."""
    mask = tree_attention_mask(tree.visibility, prefix_len, q.dtype, sliding_window=window, depths=tree.depths)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask
    return torch.softmax(scores, dim=-1) @ v


def make_case(rng: random.Random, dtype, heads, ratio, head_dim, prefix_len, n, window, batch=1):
    tree = random_tree(n, rng, batch)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    hkv = heads // ratio
    q = torch.randn(batch, heads, n, head_dim, generator=g, dtype=dtype)
    k = torch.randn(batch, hkv, prefix_len + n, head_dim, generator=g, dtype=dtype)
    v = torch.randn(batch, hkv, prefix_len + n, head_dim, generator=g, dtype=dtype)
    return tree, q, k, v


def check_split(tree, q, k, v, prefix_len, window, kernel) -> float:
    ref = dense_reference(q, k, v, tree, prefix_len, window)
    out = split_tree_attention(
        q, k[:, :, :prefix_len], v[:, :, :prefix_len], k[:, :, prefix_len:], v[:, :, prefix_len:],
        tree.visibility, tree.depths, window=window, prefix_kernel=KERNELS[kernel][0],
        block_kernel=KERNELS[kernel][1],
    )
    assert out.dtype == q.dtype and out.shape == q.shape
    return float((out - ref).abs().max())


def sampled_cases(count: int, seed: int):
    """Random shapes from the issue's grid; the head count shrinks so that no case costs more than ~1M scores."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        ratio = rng.choice([1, 2, 4, 8])
        heads = ratio * rng.choice([1, 2, 4])
        head_dim = rng.choice([64, 128])
        prefix_len = rng.choice([0, 1, 7, 300, 2048])
        n = min(256, int(math.exp(rng.uniform(0, math.log(256)))))
        while heads > ratio and heads * n * (prefix_len + n) > 1_000_000:
            heads //= 2
        window = rng.choice([None, None, 1, 2, 3, 16, prefix_len // 2 + 1, prefix_len + n + 3])
        cases.append((seed * 100 + i, heads, ratio, head_dim, prefix_len, n, window, rng.choice([1, 1, 2])))
    return cases


@pytest.mark.parametrize("kernel", ["torch", "fused"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_split_equals_dense_on_random_shapes(dtype, kernel):
    worst = 0.0
    for case_seed, heads, ratio, head_dim, prefix_len, n, window, batch in sampled_cases(10, seed=1):
        rng = random.Random(case_seed)
        tree, q, k, v = make_case(rng, dtype, heads, ratio, head_dim, prefix_len, n, window, batch)
        err = check_split(tree, q, k, v, prefix_len, window, kernel)
        assert err < TOL[dtype], (heads, ratio, head_dim, prefix_len, n, window, batch, err)
        worst = max(worst, err)
    print(f"worst max-abs error {worst:.2e}")


def test_split_equals_dense_at_the_extremes_of_the_grid():
    """32 heads at GQA 8 over a 2048 prefix, and 256 nodes: the corners the sampled cases thin out."""
    rng = random.Random(7)
    dtype = torch.float64
    for heads, ratio, head_dim, prefix_len, n, window in [
        (32, 8, 128, 2048, 16, None),
        (32, 4, 64, 2048, 8, 700),
        (2, 2, 64, 2048, 256, None),
        (8, 1, 128, 300, 256, 5),
    ]:
        tree, q, k, v = make_case(rng, dtype, heads, ratio, head_dim, prefix_len, n, window)
        for kernel in KERNELS:
            assert check_split(tree, q, k, v, prefix_len, window, kernel) < TOL[dtype]


@pytest.mark.parametrize(
    "prefix_len, n, window, chain",
    [
        (0, 9, None, False),  # empty prefix
        (0, 12, 3, True),  # empty prefix, window shorter than the depth
        (40, 1, None, False),  # single-node tree
        (40, 1, 1, False),  # single node that sees only itself
        (20, 11, 3, True),  # depth 10 > window 3: deep nodes see no prefix and only near ancestors
        (20, 11, 1, True),  # window 1: every node sees only itself
        (5, 30, 2, False),  # window reaches into the prefix only for shallow nodes
        (7, 16, 10_000, False),  # a window longer than everything changes nothing
    ],
)
def test_edge_cases(prefix_len, n, window, chain):
    rng = random.Random(prefix_len * 31 + n)
    for dtype in (torch.float64, torch.float32):
        tree, q, k, v = make_case(rng, dtype, 4, 2, 64, prefix_len, n, window)
        if chain:
            parents = torch.arange(-1, n - 1)[None]
            tree = DraftTree.from_parents(torch.zeros_like(parents), parents)
        for kernel in KERNELS:
            assert check_split(tree, q, k, v, prefix_len, window, kernel) < TOL[dtype]


def test_window_one_is_attention_to_self():
    rng = random.Random(3)
    tree, q, k, v = make_case(rng, torch.float64, 4, 4, 64, 10, 6, 1)
    out = split_tree_attention(q, k[:, :, :10], v[:, :, :10], k[:, :, 10:], v[:, :, 10:], tree.visibility,
                               tree.depths, window=1)
    torch.testing.assert_close(out, v[:, :, 10:].expand(-1, 4, -1, -1), rtol=0, atol=1e-12)


def test_merge_of_disjoint_key_sets_is_the_full_softmax():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 23, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 23, 16, generator=g, dtype=torch.float64)
    full_out, full_lse = attention_with_lse(q, k, v, 0.25)
    for cut in (0, 1, 11, 23):
        o1, l1 = attention_with_lse(q, k[:, :, :cut], v[:, :, :cut], 0.25)
        o2, l2 = attention_with_lse(q, k[:, :, cut:], v[:, :, cut:], 0.25)
        out, lse = merge_attention(o1, l1, o2, l2)
        torch.testing.assert_close(out, full_out, rtol=0, atol=1e-12)
        torch.testing.assert_close(lse, full_lse, rtol=0, atol=1e-12)
        for dtype in (torch.float64, torch.float32):  # in place: the same bits, in the inputs' own storage
            a, b = o1.to(dtype), o2.to(dtype)
            want = merge_attention(a, l1, b, l2)[0]
            got = merge_attention(a.clone(), l1, b.clone(), l2, inplace=True)[0]
            assert torch.equal(got, want)
    # An empty side merges as nothing; two empty sides stay empty instead of NaN.
    empty = torch.full_like(full_lse, float("-inf"))
    out, lse = merge_attention(torch.zeros_like(full_out), empty, full_out, full_lse)
    torch.testing.assert_close(out, full_out, rtol=0, atol=0)
    out, lse = merge_attention(torch.zeros_like(full_out), empty, torch.zeros_like(full_out), empty)
    assert not out.isnan().any() and torch.isinf(lse).all()


def test_kernels_return_the_log_sum_exp():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 8, 7, 64, generator=g)
    k = torch.randn(1, 2, 1100, 64, generator=g)
    v = torch.randn(1, 2, 1100, 64, generator=g)
    ref_out, ref_lse = attention_with_lse(q, k, v, 0.125)
    for kernel, _ in KERNELS.values():
        out, lse = kernel(q, k, v, 0.125)
        torch.testing.assert_close(out.float(), ref_out, rtol=0, atol=1e-5)
        torch.testing.assert_close(lse.float(), ref_lse, rtol=0, atol=1e-5)
    allowed = torch.rand(1, 7, 1100, generator=g) < 0.3
    allowed[..., 0] = True
    ref_out, ref_lse = attention_with_lse(q, k, v, 0.125, allowed)
    out, lse = fused_block_kernel(q, k, v, 0.125, allowed)
    torch.testing.assert_close(out.float(), ref_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.float(), ref_lse, rtol=0, atol=1e-5)


def test_bf16_split_is_close_to_float32_dense():
    rng = random.Random(11)
    tree, q, k, v = make_case(rng, torch.bfloat16, 8, 4, 64, 300, 40, 17)
    ref = dense_reference(q.float(), k.float(), v.float(), tree, 300, 17)
    for kernel in KERNELS:
        out = split_tree_attention(q, k[:, :, :300], v[:, :, :300], k[:, :, 300:], v[:, :, 300:], tree.visibility,
                                   tree.depths, window=17, prefix_kernel=KERNELS[kernel][0],
                                   block_kernel=KERNELS[kernel][1])
        assert out.dtype == torch.bfloat16
        assert float((out.float() - ref).abs().max()) <= 2e-2


# --------------------------------------------------------------------------- causal path and block attention


def explicit_attention(q, k, v, allowed, scale=None):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("q_len, kv_len, window", [(9, 9, None), (1, 12, None), (4, 12, None), (9, 9, 3),
                                                   (1, 12, 4), (5, 12, 4), (6, 20, 40), (16, 50, None)])
def test_causal_attention_is_bottom_right_aligned_with_window(q_len, kv_len, window):
    g = torch.Generator().manual_seed(q_len * 100 + kv_len)
    q = torch.randn(2, 4, q_len, 32, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, kv_len, 32, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, kv_len, 32, generator=g, dtype=torch.float64)
    dist = (kv_len - q_len + torch.arange(q_len))[:, None] - torch.arange(kv_len)[None]
    allowed = (dist >= 0) & (dist < (window or 10**9))
    out = causal_attention(q, k, v, scale=1 / math.sqrt(32), window=window)
    torch.testing.assert_close(out, explicit_attention(q, k, v, allowed), rtol=0, atol=1e-12)
    # Left padding: padded keys vanish for real queries, and a padded query does not turn into NaN.
    padding = torch.ones(2, kv_len, dtype=torch.bool)
    padding[1, :2] = False
    out = causal_attention(q, k, v, scale=1 / math.sqrt(32), window=window, key_padding=padding)
    ref = explicit_attention(q, k, v, allowed & padding[:, None, None, :])
    real = torch.arange(q_len) + kv_len - q_len >= 2
    torch.testing.assert_close(out[1][:, real], ref[1][:, real], rtol=0, atol=1e-12)
    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=1e-12)
    assert not out.isnan().any()


@pytest.mark.parametrize("window, q_offset", [(None, None), (3, None), (5, 4), (1, None), (100, 2)])
def test_block_attention_applies_the_dflash_window(window, q_offset):
    g = torch.Generator().manual_seed(5)
    ctx, block = 13, 6
    q = torch.randn(2, 8, block, 64, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, ctx + block, 64, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, ctx + block, 64, generator=g, dtype=torch.float64)
    offset = ctx if q_offset is None else q_offset
    dist = (offset + torch.arange(block))[:, None] - torch.arange(ctx + block)[None]
    allowed = dist.abs() < (window or 10**9)  # p - w + 1 .. p + w - 1, in both directions (not causal)
    out = block_attention(q, k, v, window=window, q_offset=q_offset)
    torch.testing.assert_close(out, explicit_attention(q, k, v, allowed), rtol=0, atol=1e-12)
    # An additive mask stacks on top of the window.
    extra = torch.zeros(1, 1, block, ctx + block, dtype=torch.float64)
    extra[..., :2] = float("-inf")
    out = block_attention(q, k, v, window=window, q_offset=q_offset, additive_mask=extra, backend="sdpa")
    torch.testing.assert_close(out, explicit_attention(q, k, v, allowed & (extra == 0)), rtol=0, atol=1e-12)


def test_block_attention_flash_request_fails_clearly_without_cuda():
    q = torch.randn(1, 2, 3, 16)
    k = torch.randn(1, 2, 5, 16)
    with pytest.raises(ValueError, match="flash_attn block attention needs"):
        block_attention(q, k, k, window=2, backend="flash_attn")


# --------------------------------------------------------------------------- backends and the HF registration


def test_backend_names_and_auto_choice():
    assert isinstance(get_backend("sdpa"), DenseMaskBackend) and isinstance(get_backend(None), DenseMaskBackend)
    assert get_backend("split").implementation == "ddtree_split"
    assert get_backend("fused").name == get_backend("torch_cuda").name == "fused"
    assert auto_backend_name("cpu") == "fused"
    assert auto_backend_name("cuda") == ("flash_attn" if flash_attn_available() else "fused")
    assert isinstance(get_backend("auto"), AutoBackend)
    cpu_auto = get_backend("auto", device="cpu")
    assert cpu_auto.name == "fused" and cpu_auto.dense_below == CPU_DENSE_BELOW
    cuda_auto = get_backend("auto", device="cuda")  # resolving needs no GPU; the H200 crossover, not the CPU's
    assert cuda_auto.dense_below == (0 if flash_attn_available() else CUDA_DENSE_BELOW)
    assert CUDA_DENSE_BELOW > CPU_DENSE_BELOW
    # Below the crossover the CPU auto backend hands over the dense mask, above it the tree spec.
    model = tiny_hf_target("llama")
    tree = DraftTree.from_parents(torch.tensor([[1, 2, 3]]), torch.tensor([[-1, 0, 1]]))
    cpu_auto.prepare(model)  # a backend's kwargs need the implementation it sets (checked at every forward)
    assert "attention_mask" in cpu_auto.tree_forward_kwargs(model, tree, CPU_DENSE_BELOW - 1, torch.float64)
    assert TREE_KWARG in cpu_auto.tree_forward_kwargs(model, tree, CPU_DENSE_BELOW, torch.float64)
    auto = get_backend("auto")
    auto.prepare(model)
    assert auto.name == "fused" and model.config._attn_implementation == "ddtree_fused"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("nope")
    if not flash_attn_available():
        with pytest.raises(ValueError, match="flash-attn package"):
            get_backend("flash_attn")


def tiny_hf_target(kind: str, dtype=torch.float64):
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen3Config

    common = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2)
    if kind == "llama":
        cfg = LlamaConfig(**common)
    elif kind == "qwen3-sliding":
        cfg = Qwen3Config(head_dim=8, use_sliding_window=True, sliding_window=4, max_window_layers=1, **common)
    else:
        cfg = Gemma3TextConfig(head_dim=8, sliding_window=5, layer_types=["sliding_attention", "full_attention",
                                                                           "sliding_attention"], **common)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).to(dtype).eval()


def run_target(model, backend, tree: DraftTree, prompt: torch.Tensor):
    """Prefill in two chunks, one decode step, then the tree verify forward: the generator's call pattern."""
    from transformers import DynamicCache

    backend.prepare(model)
    cache = DynamicCache()
    outs = []
    with torch.no_grad():
        outs.append(model(input_ids=prompt[:, :-3], use_cache=True, **cache_kwargs(model, cache)).logits)
        outs.append(model(input_ids=prompt[:, -3:-1], use_cache=True, **cache_kwargs(model, cache)).logits)
        outs.append(model(input_ids=prompt[:, -1:], use_cache=True, **cache_kwargs(model, cache)).logits)
        prefix_len = cache.get_seq_length()
        kwargs = backend.tree_forward_kwargs(model, tree, prefix_len, torch.float64)
        out = model(input_ids=tree.tokens, position_ids=prefix_len + tree.depths, use_cache=True,
                    output_hidden_states=True, **cache_kwargs(model, cache), **kwargs)
    return outs + [out.logits, out.hidden_states[-1]]


@pytest.mark.parametrize("kind", ["llama", "qwen3-sliding", "gemma3-sliding"])
def test_registered_attention_matches_dense_mask_in_hf_models(kind):
    model = tiny_hf_target(kind)
    rng = random.Random(2)
    tree = random_tree(12, rng)  # depth up to 11 > the sliding windows (4, 5)
    tree = DraftTree.from_parents(torch.randint(0, 61, (1, 12)), tree.parents)
    prompt = torch.randint(0, 61, (1, 14))
    dense = run_target(model, get_backend("sdpa"), tree, prompt)
    for name in ("split", "fused"):
        split = run_target(model, get_backend(name), tree, prompt)
        assert model.config._attn_implementation == get_backend(name).implementation
        for a, b in zip(split, dense):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_softcapped_target_matches_eager():
    """Gemma 2 soft-caps its logits: prefill, decode and the tree forward agree with eager (float32 softmax there)."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, sliding_window=5, attn_logit_softcapping=2.0)
    model = AutoModelForCausalLM.from_config(cfg).double().eval()
    tree = DraftTree.from_parents(torch.randint(0, 61, (1, 8)), torch.tensor([[-1, 0, 1, 2, 3, 4, 0, 6]]))
    prompt = torch.randint(0, 61, (1, 12))

    class Eager(DenseMaskBackend):
        def prepare(self, model):
            model.set_attn_implementation("eager")

    ref = run_target(model, Eager(), tree, prompt)
    for a, b in zip(run_target(model, get_backend("fused"), tree, prompt), ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["llama", "gemma3-sliding"])
def test_plain_forward_with_left_padding_matches_sdpa(kind):
    model = tiny_hf_target(kind)
    ids = torch.randint(0, 61, (2, 12))
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, :3] = 0
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=padding).logits
        get_backend("fused").prepare(model)
        out = model(input_ids=ids, attention_mask=padding).logits
    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=1e-10)
    torch.testing.assert_close(out[1, 3:], ref[1, 3:], rtol=0, atol=1e-10)
    assert not out.isnan().any()


def test_registered_by_name_without_patching():
    """``attn_implementation="ddtree_split"`` at load time, no model edits: the tree kwarg reaches every layer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    register_attention_implementations()  # what a user does before loading by name (a backend's prepare does it too)

    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="ddtree_split").double().eval()
    assert model.config._attn_implementation == "ddtree_split"
    tree = DraftTree.from_parents(torch.tensor([[3, 4, 5, 6]]), torch.tensor([[-1, 0, 0, 1]]))
    prompt = torch.randint(0, 50, (1, 6))
    backend = SplitBackend("split")
    split = run_target(model, backend, tree, prompt)
    dense = run_target(model, get_backend("sdpa"), tree, prompt)
    torch.testing.assert_close(split[3], dense[3], rtol=0, atol=1e-10)
    # A tree kwarg with the wrong node count is refused, not silently misapplied.
    from ddtree.targets.registration import TreeAttentionSpec

    other = TreeAttentionSpec.from_tree(DraftTree.from_parents(torch.tensor([[1, 2]]), torch.tensor([[-1, 0]])))
    backend.prepare(model)
    with pytest.raises(ValueError, match="tree spec has 2 nodes"), torch.no_grad():
        model(input_ids=tree.tokens, **{TREE_KWARG: other})


def test_dense_mask_still_works_on_a_split_prepared_model():
    model = tiny_hf_target("qwen3-sliding")
    tree = DraftTree.from_parents(torch.tensor([[3, 4, 5, 6, 7]]), torch.tensor([[-1, 0, 1, 2, 0]]))
    prompt = torch.randint(0, 61, (1, 9))
    dense = run_target(model, get_backend("sdpa"), tree, prompt)
    get_backend("split").prepare(model)

    class KeepImplementation(DenseMaskBackend):
        def prepare(self, model):  # leave the split implementation in place
            pass

    mixed = run_target(model, KeepImplementation(), tree, prompt)
    torch.testing.assert_close(mixed[3], dense[3], rtol=0, atol=1e-10)


# --------------------------------------------------------------------------- bench and GPU-check script, on CPU


def test_attention_bench_runs_tiny_on_cpu(tmp_path, capsys):
    from ddtree.bench.__main__ import main
    from ddtree.targets import native

    out = tmp_path / "bench.json"
    result = main(["attention", "--device", "cpu", "--contexts", "16,40", "--budgets", "0,3,9", "--heads", "4",
                   "--kv-heads", "2", "--head-dim", "16", "--dtype", "fp32", "--warmup", "0", "--repeats", "1",
                   "--window", "8", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["rows"] == result["rows"]
    backends = {"sdpa", "split", "fused"} | ({"exact"} if native.available() else set())
    assert {r["backend"] for r in saved["rows"]} == backends
    assert len(saved["rows"]) == 2 * 3 * len(backends)  # budget 0: a one-token step
    assert all(r["max_abs_err_vs_fp32_dense"] < 1e-5 for r in saved["rows"])  # exact's window starts included
    assert "vs sdpa" in capsys.readouterr().out


def test_the_gpu_exactness_checks_cover_every_part():
    from gpu_exactness import CHECKS

    assert set(CHECKS) == {"split_bf16", "split_fp32", "causal_bf16", "block_bf16", "model_fp32", "model_bf16",
                           "batch_fp32", "gdn_fp32", "gdn_bf16", "compiled_fp32"}


@pytest.mark.parametrize("check", ["split_bf16", "split_fp32", "causal_bf16", "block_bf16", "model_fp32",
                                   "model_bf16", "batch_fp32", "gdn_fp32", "gdn_bf16", "compiled_fp32"])
def test_gpu_exactness_check_passes_at_the_tiny_level_on_cpu(check):
    """The checks of ``tests/test_gpu.py`` at their tiny level: every case within tolerance on the CPU."""
    from gpu_exactness import run_check

    rows = run_check(check, torch.device("cpu"), level="tiny")
    assert rows, f"{check} ran no case"
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]


# --------------------------------------------------------------------------- end to end through the generator


@pytest.mark.parametrize("kind, overrides", [("llama", {}), ("qwen3", dict(use_sliding_window=True, sliding_window=6,
                                                                           max_window_layers=2))])
def test_generation_is_lossless_and_accepts_the_same_with_every_cpu_backend(kind, overrides):
    """Greedy output equals the target's own decoding, and every backend accepts exactly what "sdpa" accepts."""
    from tiny import VOCAB, ScriptedDrafter, tiny_drafter, tiny_target

    from ddtree import SpeculativeGenerator

    target = tiny_target(kind, **overrides)
    prompts = {"dflash": [5, 17, 3, 8, 1, 2, 9], "scripted": list(range(10, 30))}
    target.set_attn_implementation("sdpa")
    for drafter_name, prompt in prompts.items():
        ref = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0)
        accepted = {}
        for attention in ("sdpa", "split", "fused", "auto"):
            if drafter_name == "dflash":
                drafter = tiny_drafter(target)
            else:
                drafter = ScriptedDrafter(ref, VOCAB, block_size=5, decoy_at={2: 0})
            gen = SpeculativeGenerator(target, drafter, tree_budget=12, attention=attention)
            out = gen.generate(torch.tensor([prompt]), max_new_tokens=24)
            assert torch.equal(out.sequences, ref), (drafter_name, attention)
            accepted[attention] = out.acceptance_lengths
        assert accepted["split"] == accepted["fused"] == accepted["auto"] == accepted["sdpa"], accepted
        if drafter_name == "scripted":
            assert max(accepted["sdpa"]) > 2  # the tree path really carried several tokens per round
        target.set_attn_implementation("sdpa")


def test_two_generators_with_different_attention_on_one_target_are_exact_or_refused():
    """A second generator switching the target's attention implementation must not leave the first one verifying
    trees under a plain causal mask: every pair of backends on one target is either exact (acceptance as
    scripted) or refused at the first tree forward, by name."""
    from tiny import VOCAB, ScriptedDrafter, tiny_target

    from ddtree import SpeculativeGenerator

    target = tiny_target("llama")
    prompt = list(range(10, 30))
    target.set_attn_implementation("sdpa")
    ref = target.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0)
    new = ref[0, len(prompt):].tolist()

    def run(gen):
        out = gen.generate(prompt, max_new_tokens=20, stop_token_ids=(), record_trees=True)
        assert torch.equal(out.sequences, ref)
        assert out.acceptance_lengths == [5] * len(out.acceptance_lengths) and len(out.acceptance_lengths) == 4
        return out

    def make(attention):
        return SpeculativeGenerator(target, ScriptedDrafter(ref, VOCAB, block_size=5), tree_budget=8,
                                    attention=attention)

    for first, second in [("split", "sdpa"), ("fused", "sdpa"), ("sdpa", "split"), ("split", "fused"),
                          ("sdpa", "auto"), ("auto", "split")]:
        target.set_attn_implementation("sdpa")
        a, b = make(first), make(second)
        run(b)  # the generator built last always runs what it set up
        if a.backend.name in ("split", "fused") and b.backend.name == "sdpa":
            with pytest.raises(RuntimeError, match=f"attention='{first}'.*now runs 'sdpa'.*same attention="):
                a.generate(prompt, max_new_tokens=20)
        else:
            run(a)
    assert len(new) == 20


def test_the_description_is_read_once_per_model(monkeypatch):
    """Windows, sinks and decoder parts come from one walk of the model, remembered on the model object: the
    rounds' mask building never walks the model again."""
    from ddtree.targets.description import describe

    model = tiny_hf_target("qwen3-sliding")
    walks = []
    original = type(model).modules

    def counted(self):
        walks.append(self)
        return original(self)

    monkeypatch.setattr(type(model), "modules", counted)
    description = describe(model)
    windows = description.windows
    assert set(windows.values()) == {None, 4} and description.sinks is False and description.stateful == ()
    decoder, blocks, post_norm_last = description.decoder_parts
    assert blocks is model.model.layers and post_norm_last
    walked = len(walks)
    tree = DraftTree.from_parents(torch.tensor([[3, 4, 5]]), torch.tensor([[-1, 0, 0]]))
    backend = get_backend("sdpa")
    for prefix in (6, 7, 8):
        backend.tree_forward_kwargs(model, tree, prefix, torch.float64)
    assert describe(model) is description and len(walks) == walked
