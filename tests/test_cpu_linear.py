"""The few-row CPU linear: exact enough, batch-invariant, and lossless inside the generator."""

from __future__ import annotations

import itertools
import json
import platform
import sys

import pytest
import torch
import torch.nn.functional as F
from test_generator import PROMPTS, expected_acceptance, reference
from tiny import ScriptedDrafter, tiny_drafter, tiny_target

from ddtree import SpeculativeGenerator
from ddtree.targets import cpu_linear, native

needs_kernel = pytest.mark.skipif(not cpu_linear.available(), reason=f"kernel: {cpu_linear.unavailable_reason()}")


def _weights(n, k, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5
    return w, (torch.randn(n, generator=g) if bias else None)


@needs_kernel
@pytest.mark.parametrize("n,k", [(64, 64), (37, 13), (1, 8), (130, 577)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_torch_linear(n, k, bias):
    w, b = _weights(n, k, bias=bias)
    for rows in (1, 2, 3, 4, 5, 9, 17, 32):
        x = torch.randn(rows, k)
        torch.testing.assert_close(cpu_linear.linear(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    x3 = torch.randn(2, 3, k)  # leading dims are kept
    out = cpu_linear.linear(x3, w, b)
    assert out.shape == (2, 3, n)
    torch.testing.assert_close(out, F.linear(x3, w, b), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_a_row_does_not_depend_on_its_batch():
    """Bit-identical rows whatever the row count: the property that lets verify and decode agree."""
    w, b = _weights(203, 577, seed=3)
    x = torch.randn(31, 577)
    full = cpu_linear.linear(x, w, b)
    for i in range(31):
        assert torch.equal(cpu_linear.linear(x[i:i + 1], w, b), full[i:i + 1]), i
    for m in (2, 3, 5, 8, 13):
        assert torch.equal(cpu_linear.linear(x[m:2 * m], w, b), full[m:2 * m]), m
    assert cpu_linear.takes(x, w, b, rows=31, max_rows=32)  # the kernel, not BLAS, gave these rows


@needs_kernel
def test_outside_its_range_it_is_torch_linear():
    w, b = _weights(48, 40)
    big = torch.randn(40, 40)
    assert torch.equal(cpu_linear.linear(big, w, b, max_rows=32), F.linear(big, w, b))
    x = torch.randn(3, 40, dtype=torch.float64)
    assert torch.equal(cpu_linear.linear(x, w.double(), b.double()), F.linear(x, w.double(), b.double()))
    xg = torch.randn(3, 40, requires_grad=True)  # no backward in the kernel: autograd falls back
    cpu_linear.linear(xg, w, b).sum().backward()
    torch.testing.assert_close(xg.grad, w.sum(0).expand(3, 40))


def test_bad_shapes_are_named():
    w, b = _weights(8, 16)
    with pytest.raises(ValueError, match="input has 15 features but the weight"):
        cpu_linear.linear(torch.randn(2, 15), w, b)
    with pytest.raises(ValueError, match="bias has shape"):
        cpu_linear.linear(torch.randn(2, 16), w, torch.zeros(7))
    with pytest.raises(ValueError, match="max_rows must be >= 1"):
        cpu_linear.install(torch.nn.Linear(4, 4), max_rows=0)


def test_unavailable_kernel_is_explained(monkeypatch):
    monkeypatch.setattr(native, "_cpu_flags", lambda: {"sse2"})
    native.library.cache_clear()
    try:
        assert not cpu_linear.available()
        assert "lacks avx2, f16c, fma" in cpu_linear.unavailable_reason()
        with pytest.raises(RuntimeError, match="unavailable: this CPU lacks avx2"):
            cpu_linear.install(torch.nn.Linear(4, 4))
        target = tiny_target("qwen3", dtype=torch.float32)
        gen = SpeculativeGenerator(target, tiny_drafter(target), cpu_linear="auto")
        assert gen.cpu_linear == 0  # auto quietly keeps the stock linears
        x = torch.randn(2, 4)
        lin = torch.nn.Linear(4, 4)
        assert torch.equal(cpu_linear.linear(x, lin.weight.detach(), lin.bias.detach()), lin(x).detach())
    finally:
        monkeypatch.undo()
        native.library.cache_clear()


@pytest.mark.parametrize("case", ["bad_compiler", "unwritable_cache"])
def test_failed_build_is_explained(monkeypatch, tmp_path, case):
    if case == "bad_compiler":
        monkeypatch.setenv("CC", "/bin/false")
        monkeypatch.setattr(native, "_build_dir", lambda: tmp_path)
        want = "with /bin/false failed"
    else:
        (tmp_path / "a_file").write_text("")
        monkeypatch.setattr(native, "_build_dir", lambda: tmp_path / "a_file" / "kernels")
        want = "set DDTREE_CACHE to a writable directory"
    monkeypatch.setattr(native, "_cpu_flags", lambda: {"avx2", "fma", "f16c"})
    native.library.cache_clear()
    try:
        if sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64"):
            assert not cpu_linear.available()
            assert want in cpu_linear.unavailable_reason()
    finally:
        monkeypatch.undo()
        native.library.cache_clear()


@needs_kernel
def test_install_uninstall_and_suspend():
    target = tiny_target("llama", dtype=torch.float32)
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        before = target(ids).logits
        n = cpu_linear.install(target)
        assert n == cpu_linear.installed(target) == 4 * 7 + 1  # q k v o gate up down per layer + lm_head
        routed = target(ids).logits
        with cpu_linear.suspended(target):
            assert cpu_linear.installed(target) == 0
            assert torch.equal(target(ids).logits, before)
        assert cpu_linear.installed(target) == n
        torch.testing.assert_close(routed, before, atol=1e-4, rtol=1e-4)
        assert cpu_linear.uninstall(target) == n
        assert torch.equal(target(ids).logits, before)


@needs_kernel
@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_generator_lossless_with_acceptance_of_a_recompute(kind):
    target = tiny_target(kind, dtype=torch.float32)
    draft = tiny_drafter(target)
    gen = SpeculativeGenerator(target, draft, tree_budget=12, cpu_linear=True)
    assert gen.cpu_linear == cpu_linear.installed(target) > 0
    assert cpu_linear.installed(draft) > 0 and cpu_linear.routed(draft.fc)  # the draft step goes through it too
    for prompt in PROMPTS:
        ref = reference(target, prompt)  # plain decoding of the same (routed) target
        out = gen.generate(torch.tensor([prompt]), max_new_tokens=64, record_trees=True)
        assert torch.equal(out.sequences, ref)
        ref_tokens = ref[0].tolist()
        assert out.acceptance_lengths == [expected_acceptance(r, ref_tokens) for r in out.rounds]


@needs_kernel
def test_agreeing_drafter_keeps_full_acceptance_with_the_kernel():
    target = tiny_target("qwen3", dtype=torch.float32)
    cpu_linear.install(target)
    ref = reference(target, PROMPTS[1], new=61)
    drafter = ScriptedDrafter(ref, vocab=target.config.vocab_size, block_size=5)
    out = SpeculativeGenerator(target, drafter, tree_budget=8).generate(torch.tensor([PROMPTS[1]]), max_new_tokens=61)
    assert torch.equal(out.sequences, ref)
    assert out.acceptance_lengths == [5] * 12


def test_generator_option_is_checked():
    target = tiny_target("qwen3")  # float64
    draft = tiny_drafter(target)
    with pytest.raises(ValueError, match="cpu_linear=True needs a float32 target on the CPU"):
        SpeculativeGenerator(target, draft, cpu_linear=True)
    with pytest.raises(ValueError, match="cpu_linear must be True, False or 'auto'"):
        SpeculativeGenerator(target, draft, cpu_linear="yes")
    assert SpeculativeGenerator(target, draft, cpu_linear="auto").cpu_linear == 0


@needs_kernel
def test_bench_times_the_stock_target_side_by_side():
    from ddtree.bench.methods import parse_methods
    from ddtree.bench.prompts import Prompt
    from ddtree.bench.report import summarize
    from ddtree.bench.runner import Bench

    methods = parse_methods("ar_stock,best_first@6")
    assert [m.name for m in methods] == ["ar", "ar_stock", "best_first@6"]
    target = tiny_target("llama", dtype=torch.float32)
    gen = SpeculativeGenerator(target, tiny_drafter(target), cpu_linear=True)
    seen = []
    real = cpu_linear.suspended

    def spy(model):
        seen.append(cpu_linear.installed(model))
        return real(model)

    import ddtree.bench.runner as runner

    runner.cpu_linear.suspended, restore = spy, real
    try:
        bench = Bench(gen, methods, max_new_tokens=24)
        runs = bench.run([Prompt("p", PROMPTS[1])], repeats=1, warmup=False, progress=False)
    finally:
        runner.cpu_linear.suspended = restore
    assert seen == [gen.cpu_linear]  # ar_stock ran once, with the kernel taken out for it
    assert cpu_linear.installed(target) == gen.cpu_linear  # and put back
    rows = {r["method"]: r for r in summarize(runs, methods, depth=4, greedy=True)}
    assert rows["best_first@6"]["lossless"] and rows["best_first@6"]["tau"] > 1.0
    assert rows["ar_stock"]["lossless"] is True  # the stock target said the same as the routed one


@needs_kernel
def test_cpu_linear_bench_command(tmp_path, capsys):
    from ddtree.bench.__main__ import main as run_main_bench

    assert run_main_bench(["cpu-linear", "--rows", "1,3,7", "--repeats", "1", "--dims", "32,16,48,2,100",
                           "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "cpu_linear.json").read_text())["rows"]
    assert [r["rows"] for r in rows] == [1, 3, 7]
    assert rows[0]["blas_vs_1row_blas"] == 1.0 and all(r["kernel_ms"] > 0 for r in rows)
    assert "| 7 |" in capsys.readouterr().out


@needs_kernel
def test_a_routed_target_compiles_whole_with_the_kernel_as_an_operator(monkeypatch):
    """A target (and drafter) routed through the kernel, compiled: the traced steps call the kernel's operator
    (every routed linear of the verify and the draft), with no graph break, and equal the dynamic round on the
    same routing in tokens, trees and acceptance, and plain decoding in tokens."""
    from test_static_round import PROMPTS as STATIC_PROMPTS
    from test_static_round import assert_same_rounds, graph_breaks, run

    from ddtree.drafters.dflash.drafter import DFlashDrafter
    from ddtree.targets import row_kernels

    target = tiny_target("qwen3", dtype=torch.float32)
    drafter = DFlashDrafter(tiny_drafter(target, block_size=5), target)
    eager = SpeculativeGenerator(target, drafter, cpu_linear=True, tree_budget=6, prompt_lookup=False)
    routed = cpu_linear.installed(target)
    assert routed > 0 and cpu_linear.installed(drafter.cpu_linear_model) > 0
    dynamic, _ = run(eager, STATIC_PROMPTS, stop_token_ids=())
    shapes = []
    product = row_kernels.packed_product
    monkeypatch.setattr(row_kernels, "packed_product", lambda x, *a, **k: shapes.append(x.shape) or product(x, *a, **k))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        compiled = SpeculativeGenerator(target, drafter, compile="eager", tree_budget=6, cpu_linear=True,
                                        prompt_lookup=False)
        assert compiled.cpu_linear == routed
        static, _ = run(compiled, STATIC_PROMPTS, stop_token_ids=())
        assert graph_breaks() == 0
    finally:
        torch._dynamo.reset()
    verify_rows = (len(STATIC_PROMPTS), 7)  # every row's 7 nodes (budget 6 and the root) in one product
    assert sum(s[:-1] == verify_rows for s in shapes) >= routed  # the verify forward's linears, all on the kernel
    assert any(s[:-1] == (len(STATIC_PROMPTS), 5) for s in shapes)  # and the draft step's (the block of 5)
    assert_same_rounds(static, dynamic, len(STATIC_PROMPTS))
    for b, prompt in enumerate(STATIC_PROMPTS):
        ref = reference(target, prompt, new=28)[0].tolist()
        assert static.new_tokens[b] == ref[len(prompt) : len(prompt) + 20]
        assert static.acceptance[b] == [expected_acceptance(r, ref) for r in static.records[b]]
    assert any(a > 1 for row in static.acceptance for a in row)  # paths past the root were committed


def test_compile_keeps_the_linears_routing():
    from ddtree.generation.options import GeneratorOptions

    assert GeneratorOptions(compile=True, tree_budget=4, cpu_linear="auto").cpu_linear == "auto"
    assert GeneratorOptions(compile=True, tree_budget=4, cpu_linear=True).cpu_linear is True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_routed_layer_repacks_its_weight_after_it_changes(dtype):
    """A routed layer multiplies by a packed copy of its weight: an in-place update, a new tensor or a dtype
    change is seen at the next call (a stale copy would give the old weight's outputs)."""
    layer = torch.nn.Linear(96, 80, bias=True).to(dtype)
    assert cpu_linear.install(layer, exact=True) == 1
    x = torch.randn(3, 96).to(dtype)
    with torch.no_grad():
        before = layer(x)
        assert torch.allclose(before.float(), F.linear(x, layer.weight, layer.bias).float(), atol=0.05, rtol=0.02)
        layer.weight.mul_(-1.0)  # in place: the same storage, a new version
        assert torch.allclose(layer(x).float(), F.linear(x, layer.weight, layer.bias).float(), atol=0.05, rtol=0.02)
        assert not torch.allclose(layer(x).float(), before.float(), atol=0.05, rtol=0.02)  # the control
        layer.weight = torch.nn.Parameter(torch.randn(80, 96).to(dtype))  # a new tensor
        assert torch.allclose(layer(x).float(), F.linear(x, layer.weight, layer.bias).float(), atol=0.05, rtol=0.02)
    cpu_linear.uninstall(layer)
    assert "_ddtree_packed_weight" not in vars(layer)  # the copy goes with the routing


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_packed_products_are_row_invariant_on_every_build(monkeypatch, threads):
    """The packed kernel's rows are bit for bit the one-row call's, for any row count and column tail, on the
    native build (AMX tiles for bfloat16 where the CPU has them), the same without AMX and the portable build;
    the float32 sums agree with float64 to rounding. On several threads, a call of 12 rows or more whose
    panels do not divide among them splits the last ones by rows."""
    from ddtree.targets import row_kernels

    torch.set_num_threads(threads)
    for arch in ("native", "vector", "avx2"):
        monkeypatch.setenv("DDTREE_KERNEL_ARCH", arch)
        native.library.cache_clear()
        try:
            # 130 columns: three panels; 327: a one-row call takes four panels at once, then the rest. 150
            # inputs: k-blocks of 64 and a part (7 to 48 rows run k-blocked), odd (bfloat16 pairs pad one)
            for dtype, n, k in itertools.product((torch.float32, torch.bfloat16, torch.float16), (130, 327),
                                                 (37, 150)):
                w, b = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
                packed = row_kernels.PackedWeight(w)
                x = torch.randn(230, k).to(dtype)  # 230 rows: past the k-blocked sizes, panels split by rows
                y = row_kernels.packed_linear(x, packed, b)
                for rows in (slice(0, 1), slice(3, 8), slice(4, 11), slice(0, 13), slice(12, 60), slice(59, 60),
                             slice(90, 200), slice(229, 230)):
                    assert torch.equal(row_kernels.packed_linear(x[rows], packed, b), y[rows]), (arch, dtype, k)
                ref = F.linear(x.double(), w.double(), b.double())
                assert (y.double() - ref).abs().max() <= 0.02 * ref.abs().max()
                assert torch.equal(row_kernels.packed_linear(x, row_kernels.PackedWeight(w.t().contiguous(),
                                                                                          transposed=True), b), y)
        finally:
            native.library.cache_clear()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_outputs_round_once_to_nearest_even(dtype):
    """Each output is its float32 sum plus bias rounded once to nearest even, as torch rounds, in every lane of
    the stores (eight at a time, then a tail): sums exact in float32, half of them on a tie (1 + half an ulp of
    the output dtype), so a wrong rounding or a shifted lane changes them."""
    from ddtree.targets import row_kernels

    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    n, k = 70, 4  # 70 columns: eight groups of eight and a tail of six
    w = torch.zeros(n, k)
    w[:, 0] = 1.0
    w[:, 1] = ulp / 2 * (torch.arange(n) % 4)  # 0, a tie, one ulp, a tie above it
    w[:, 2] = torch.arange(n) % 3 - 1.0
    bias = torch.zeros(n)
    bias[1::5] = -2.0
    for rows in (1, 13):
        x = torch.ones(rows, k)
        x[:, 2] = torch.arange(rows) % 2
        got = row_kernels.packed_linear(x.to(dtype), row_kernels.PackedWeight(w.to(dtype)), bias.to(dtype))
        assert torch.equal(got, (x @ w.t() + bias).to(dtype))
    w[5, 3] = float("nan")
    got = row_kernels.packed_linear(torch.ones(2, k).to(dtype), row_kernels.PackedWeight(w.to(dtype)))
    assert got[:, 5].isnan().all() and not got[:, 4].isnan().any()


def test_bfloat16_products_run_on_amx_tiles_where_the_cpu_has_them(monkeypatch):
    """On a CPU with AMX-BF16 the native build multiplies bfloat16 on tiles for every row count, and the vector
    build does not: their bits differ (so the invariance test above covers two kernels, not one twice), and
    both are the product to rounding."""
    from ddtree.targets import row_kernels

    if "amx_bf16" not in native._cpu_flags():
        pytest.skip("this CPU has no AMX-BF16")
    torch.manual_seed(0)
    w, x = torch.randn(200, 150).bfloat16(), torch.randn(13, 150).bfloat16()
    ref = F.linear(x.double(), w.double())
    # a sum whose value depends on its order far past rounding: 2^24, thirty ones, -2^24 (the ones vanish
    # into 2^24 when added to it one at a time)
    wc = torch.ones(64, 32)
    wc[:, 0], wc[:, 31] = 2.0**24, -2.0**24
    out = {}
    try:
        for arch in ("native", "vector"):
            monkeypatch.setenv("DDTREE_KERNEL_ARCH", arch)
            native.library.cache_clear()
            y = row_kernels.packed_linear(x, row_kernels.PackedWeight(w))
            assert native.uses_amx() == (arch == "native")
            assert (y.double() - ref).abs().max() <= 0.02 * ref.abs().max()
            out[arch] = row_kernels.packed_linear(torch.ones(3, 32).bfloat16(), row_kernels.PackedWeight(wc.bfloat16()))
    finally:
        native.library.cache_clear()
    assert not torch.equal(out["native"], out["vector"])


def test_bfloat16_layers_are_routed_where_their_products_run_on_amx(monkeypatch):
    """The inexact routing takes a bfloat16 layer where the products run on AMX tiles (the native build on such
    a CPU) and leaves it to torch elsewhere (the build without AMX), where oneDNN is faster past a few rows; an
    exact generator's bfloat16 drafter is routed there too, and also where the products run on the AVX512-BF16
    dot product (a drafter's few-row products beat torch's there)."""
    try:
        for arch in ("native", "vector"):
            monkeypatch.setenv("DDTREE_KERNEL_ARCH", arch)
            native.library.cache_clear()
            layer = torch.nn.Linear(96, 80).bfloat16()
            routed = cpu_linear.install(layer)
            assert routed == int(native.uses_amx()) and cpu_linear.fast_dtype(torch.bfloat16) == native.uses_amx()
            x = torch.randn(5, 96).bfloat16()
            with torch.no_grad():
                assert torch.allclose(layer(x).float(), F.linear(x, layer.weight, layer.bias).float(), atol=0.05,
                                      rtol=0.02)
            cpu_linear.uninstall(layer)
            target = tiny_target("qwen3", dtype=torch.bfloat16)
            gen = SpeculativeGenerator(target, tiny_drafter(target), numerics="exact")
            assert (cpu_linear.installed(gen.drafter.cpu_linear_model) > 0) == (native.uses_amx()
                                                                               or native.uses_paired_bf16())
    finally:
        native.library.cache_clear()


@needs_kernel
def test_a_layer_made_in_inference_mode_is_routed():
    """A target built under ``torch.inference_mode`` has weights without version counters: the packed copy
    still knows its source (by storage and identity) rather than failing on the first call."""
    with torch.inference_mode():
        layer = torch.nn.Linear(40, 24)
        cpu_linear.install(layer, exact=True)
        x = torch.randn(3, 40)
        assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        assert torch.equal(layer(x[:1]), layer(x)[:1])
    cpu_linear.uninstall(layer)
