"""The packed row kernel as a torch operator: the eager kernel's bits, one opaque node in a traced graph, and the
packed weight a compiled step reads kept current (packed again, in place, after the weight changed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddtree.targets import cpu_linear, kernel_ops, row_kernels

needs_kernel = pytest.mark.skipif(not cpu_linear.available(), reason=f"kernel: {cpu_linear.unavailable_reason()}")


def _layer(n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(k, n, bias=bias).to(dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_the_operator_gives_the_eager_kernels_bits(dtype, bias):
    layer = _layer(70, 130, dtype, bias)
    w = layer.weight.detach()
    packed = row_kernels.PackedWeight(w)
    b = None if layer.bias is None else layer.bias.detach()
    for shape in ((1, 130), (3, 5, 130), (33, 130)):
        x = torch.randn(shape).to(dtype)
        out = kernel_ops.packed_linear(x, w, packed.data, b, packed.n, packed.k)
        assert out.shape == (*shape[:-1], 70) and out.dtype == dtype
        assert torch.equal(out, row_kernels.packed_linear(x, packed, b))
    if dtype == torch.float32:  # the control: a sum rounded once (float64, then float32) differs somewhere
        wide = torch.randn(33, 130)
        once = F.linear(wide.double(), layer.weight.double(), None if b is None else b.double()).float()
        assert not torch.equal(kernel_ops.packed_linear(wide, w, packed.data, b, 70, 130), once)


@needs_kernel
def test_a_traced_routed_linear_is_one_operator_node():
    """Traced, a routed layer whose weight is packed is one ``ddtree.packed_linear`` node for the rows the
    routing takes (float32 calls of at most ``max_rows``), and ``F.linear`` past them or before packing."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 8, bias=False))
    cpu_linear.install(model, max_rows=4)
    seen: list[list[str]] = []

    def backend(gm, inputs):
        seen.append([str(node.target) for node in gm.graph.nodes if node.op == "call_function"])
        return gm

    def unrouted(x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.relu(F.linear(x, model[0].weight, model[0].bias)), model[2].weight)

    def ops(rows: int, packed: bool) -> list[str]:
        torch._dynamo.reset()
        torch.manual_seed(rows)
        with torch.inference_mode():
            x = torch.randn(rows, 16)
            out = torch.compile(model, backend=backend, fullgraph=True)(x)
            # the eager routed forward's bits where the graph calls the kernel, else F.linear's
            assert torch.equal(out, model(x) if packed else unrouted(x))
        return [op for op in seen[-1] if "linear" in op]

    try:
        assert ops(3, packed=False) == ["<built-in function linear>"] * 2  # nothing packed yet: a graph cannot pack
        assert cpu_linear.pack_routed(model) == 2
        assert ops(3, packed=True) == ["ddtree.packed_linear.default"] * 2
        assert ops(5, packed=False) == ["<built-in function linear>"] * 2  # past max_rows: BLAS, as in eager
    finally:
        torch._dynamo.reset()


@needs_kernel
def test_a_compiled_step_follows_a_weight_changed_in_place():
    """A compiled step reads the packed bytes; after an in-place weight change its operator packs the new
    weight into the same bytes first, as the eager routing would: the eager forward's bits on the new weight,
    no recompile, and the C layers' plans holding the bytes see it too."""
    layer = _layer(32, 48, torch.float32, bias=True)
    cpu_linear.install(layer)
    cpu_linear.pack_routed(layer)
    data = cpu_linear.packed_weight(layer).data
    step = torch.compile(layer, backend="eager", fullgraph=True)
    x = torch.randn(2, 48)
    torch._dynamo.utils.counters.clear()
    try:
        with torch.inference_mode():
            before = step(x)
            assert torch.equal(before, layer(x))
        with torch.no_grad():
            layer.weight.mul_(-0.5)
        with torch.inference_mode():
            after = step(x)
            assert not torch.equal(after, before)  # the control: the old packing would give ``before``
            assert torch.equal(after, layer(x))
            torch.testing.assert_close(after, F.linear(x, layer.weight, layer.bias))
        assert cpu_linear.packed_weight(layer).data is data  # the same bytes, packed again
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # no recompile for the change
    finally:
        torch._dynamo.reset()


@needs_kernel
def test_a_packed_weight_repacks_in_place_only_what_fits():
    w = torch.randn(16, 24)
    packed = row_kernels.PackedWeight(w)
    data = packed.data
    w2 = torch.randn(16, 24)
    assert not packed.packed_from(w2)
    packed.repack(w2)
    assert packed.packed_from(w2) and packed.data is data
    assert torch.equal(row_kernels.packed_linear(torch.ones(1, 24), packed), row_kernels.packed_linear(
        torch.ones(1, 24), row_kernels.PackedWeight(w2)))
    assert row_kernels.packed_for(data) is packed
    with pytest.raises(ValueError, match="does not fit"):
        packed.repack(torch.randn(24, 16))


@needs_kernel
def test_the_operator_has_a_shape_for_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    w = torch.randn(12, 20)
    packed = row_kernels.PackedWeight(w)
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(2, 3, 20))
        out = kernel_ops.packed_linear(x, mode.from_tensor(w), mode.from_tensor(packed.data), None, 12, 20)
    assert out.shape == (2, 3, 12) and out.dtype == torch.float32
