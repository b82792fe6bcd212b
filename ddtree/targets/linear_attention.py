"""Tree verification through Gated DeltaNet (GDN) linear-attention layers (Qwen3.5/3.6, Qwen3-Next).

A GDN layer carries a depthwise causal conv window and a recurrent state from token
to token. transformers' own GDN forward treats its input as ONE chain that continues
the cached state, so on a flattened tree siblings would mix. Here each node gets:

- the conv over its own window: its K-1 nearest ancestors (topped up from the cached
  conv window for shallow nodes) and itself, gathered by a table built once per forward;
- the recurrence from its parent's state, run depth by depth with the nodes of one
  depth as the batch (transformers' recurrent gated-delta step, or its fused kernel
  when installed); a chain runs as one call over the whole block.

The verify forward never writes the cache. It stashes each node's small recurrence
inputs (q, k, v, g, beta) and conv inputs as pending, in ddtree's own table keyed by the
cache object (transformers' object is left as it is), and
:func:`commit_linear_states` (called by :func:`ddtree.targets.cache.commit_accepted`) replays
each row's accepted path from the committed state: the last accepted node's state and
the conv window along the path become the cache. Keeping inputs instead of per-node
states is what makes a 64-node tree affordable on a 27B target (design.md).

The static round (``compile=True``) runs the same arithmetic in fixed shapes, with no host reads:
:func:`static_tree_forward` (the conv table in tensor ops, the recurrence once per depth up to a bound for
every node, each node keeping its own depth's step) and :func:`static_commit` (each row's accepted path
replayed over a fixed number of masked steps), on the buffers of :class:`StaticLinearStates`, which the kind
makes for :class:`~ddtree.targets.static_cache.RowPackedCache` (``static_states``) and the patched forward finds
in its cache.

``prepare(model)`` patches the GDN modules' ``forward`` on the instances (reversible with
:func:`unprepare`); without a tree they run transformers' forward untouched. :class:`GatedDeltaNet` is this
module behind :class:`ddtree.targets.layer_kinds.StatefulLayerKind`, the interface the rest of the target
side calls.
"""

from __future__ import annotations

import functools
import re
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ddtree.core.tree import DraftTree
from ddtree.runtime.invariant import elementwise
from ddtree.targets.cpu_linear import in_bulk

LINEAR_TREE_KWARG = "ddtree_linear_tree"
"""Forward kwarg carrying the :class:`DraftTree` to the GDN layers (popped at the model's top)."""

GDN_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
"""Model types whose linear-attention layers ddtree verifies as trees."""

_PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""cache object -> {layer_idx: _Pending}: a verify forward's uncommitted inputs, dropped with the cache."""

GDN_CHUNK = 64
"""transformers' chunked gated-delta rule works in blocks of 64 tokens: a prefill split at multiples of it
runs the same arithmetic as one forward (float64: equal bits), other splits differ in the last bits."""


def _pending(cache: Any) -> dict[int, _Pending]:
    return (_PENDING.get(cache) if cache is not None else None) or {}


def gdn_modules(model: Any) -> list[torch.nn.Module]:
    """The Gated DeltaNet modules of ``model`` in layer order (empty for attention-only models)."""
    found = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    return sorted(found, key=lambda m: m.layer_idx)


# --------------------------------------------------------------------------- per-forward plan


@dataclass(eq=False)
class LinearTreePlan:
    """Index tables for one tree forward, shared by every GDN layer.

    Nodes are addressed flat (``row * N + node``). ``levels[d]`` holds the flat ids of
    the depth-``d`` nodes and, for each, the slot of its parent among depth ``d-1``'s
    results (for the roots, its row: the committed state). A chain needs no levels (it
    runs as one sequence), so they are left empty for it.
    """

    batch: int
    num_nodes: int
    parents: np.ndarray  # [B, N]
    depths: np.ndarray  # [B, N]
    levels: list[tuple[torch.Tensor, torch.Tensor]]
    is_chain: bool
    _conv_index: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_tree(cls, tree: DraftTree) -> LinearTreePlan:
        parents = tree.parents.detach().cpu().numpy()
        depths = tree.depths.detach().cpu().numpy()
        bsz, n = parents.shape
        is_chain = bool((parents[:, 1:] == np.arange(n - 1)).all()) if n > 1 else True
        levels = []
        slot_of = np.zeros((bsz, n), dtype=np.int64)  # a node's position within its depth's batch
        device = tree.parents.device
        for d in range(0 if is_chain else int(depths.max()) + 1):
            rows, nodes = np.nonzero(depths == d)
            slot_of[rows, nodes] = np.arange(len(rows))
            parent_slot = rows if d == 0 else slot_of[rows, parents[rows, nodes]]
            levels.append((torch.as_tensor(rows * n + nodes, device=device),
                           torch.as_tensor(parent_slot, device=device)))
        return cls(bsz, n, parents, depths, levels, is_chain)

    @classmethod
    def root_only(cls, batch: int, device: torch.device | str) -> LinearTreePlan:
        """The plan of a one-token step: each row's root alone."""
        rows = torch.arange(batch, device=device)
        return cls(batch, 1, np.full((batch, 1), -1), np.zeros((batch, 1), dtype=np.int64), [(rows, rows)], True)

    def steps(self, device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:attr:`levels`, made for a chain too (depth ``d`` is node ``d`` of every row, its parent in the row's
        slot): the exact recurrence runs every tree, chains included, one depth at a time."""
        if self.levels:
            return self.levels
        rows = torch.arange(self.batch, device=device)
        return [(rows * self.num_nodes + d, rows) for d in range(self.num_nodes)]

    def conv_index(self, kernel: int, device: torch.device | str) -> torch.Tensor:
        """``[B, N*K]`` indices into ``[cached window (K) | tree inputs (N)]``: each node's window, oldest first."""
        key = (kernel, str(device))
        if key not in self._conv_index:
            bsz, n = self.parents.shape
            rows = np.arange(bsz)[:, None]
            node = np.tile(np.arange(n), (bsz, 1))  # walks up one ancestor per step back
            table = np.empty((bsz, n, kernel), dtype=np.int64)
            for back in range(kernel):  # column kernel-1-back holds the input `back` steps before each node
                table[:, :, kernel - 1 - back] = np.where(back <= self.depths, kernel + node,
                                                          kernel - (back - self.depths))
                node = np.where(back < self.depths, self.parents[rows, node], node)
            self._conv_index[key] = torch.as_tensor(table.reshape(bsz, n * kernel), device=device)
        return self._conv_index[key]


# --------------------------------------------------------------------------- cache access (version quirks)


def _states(cache: Any, idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The committed ``(conv window [B, C, K], recurrent state [B, HV, Dk, Dv])`` of GDN layer ``idx``."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        layer = layers[idx]
        return layer.conv_states[0], layer.recurrent_states[0]
    return cache.conv_states[idx], cache.recurrent_states[idx]  # transformers 5.0's Qwen3NextDynamicCache


def _committed_states(cache: Any, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_states` of a GDN layer that must hold a committed state (after the prefill)."""
    conv, state = _states(cache, idx)
    if conv is None or state is None:
        raise ValueError(f"GDN layer {idx} of the target cache holds no state: prefill the prompt into it first")
    return conv, state


def _set_states(cache: Any, idx: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        layer = layers[idx]
        layer.conv_states[0] = conv
        layer.recurrent_states[0] = recurrent
    else:
        cache.conv_states[idx] = conv
        cache.recurrent_states[idx] = recurrent


def new_hybrid_cache(model: Any) -> Any:
    """A cache with conv/recurrent slots for the GDN layers and full-length KV for attention layers."""
    config = model.config
    module = sys.modules[type(model).__module__]
    legacy = [getattr(module, n) for n in dir(module) if n.endswith("DynamicCache") and n != "DynamicCache"]
    if legacy:  # transformers 5.0: the model family ships its own hybrid cache class
        return legacy[0](config)
    from transformers import DynamicCache, DynamicLayer

    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False):
            cache.layers[i] = DynamicLayer()  # ddtree applies windows through masks; compaction needs every position
    return cache


# --------------------------------------------------------------------------- the tree forward of one GDN layer


@dataclass
class _Pending:
    """One layer's verify-forward inputs, kept until commit (never the committed state itself)."""

    conv_inputs: torch.Tensor  # [B, C, N] raw conv inputs of the tree nodes
    q: torch.Tensor  # [B, N, H, Dk] after the conv (heads already matched to the value heads)
    k: torch.Tensor
    v: torch.Tensor  # [B, N, HV, Dv]
    g: torch.Tensor  # [B, N, HV]
    beta: torch.Tensor  # [B, N, HV]
    fn: Callable[..., Any] | None  # the layer's recurrent gated-delta function for the replay at commit; None
    # under exact numerics: q, k, v, g, beta are then _normalised's (g as the decay) and the replay is _delta_step


def _recurrent_fn(module: Any) -> Callable[..., Any]:
    """transformers' recurrent gated-delta step for this module (the fla kernel when transformers picked it)."""
    fn = getattr(module, "recurrent_gated_delta_rule", None)
    if fn is None:
        fn = sys.modules[type(module).__module__].torch_recurrent_gated_delta_rule
    return fn


def _chunk_fn(module: Any) -> Callable[..., Any]:
    """transformers' chunked gated-delta rule (its multi-token path; the fla kernel when transformers picked it)."""
    fn = getattr(module, "chunk_gated_delta_rule", None)
    if fn is None:
        fn = sys.modules[type(module).__module__].torch_chunk_gated_delta_rule
    return fn


CHUNKED_CHAIN_FROM = 32
"""Chains of at least this many nodes run transformers' chunked rule (what its own multi-token forward does);
shorter ones its recurrent step, which measured faster below that on a CPU (docs/benchmarks.md)."""


def _project(module: Any, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module's own projections: ``(conv inputs [B, N, C], z [B, N, HV, Dv], b, a)``."""
    bsz, n, _ = hidden.shape
    if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next packs q, k, v, z (and b, a) per key head
        q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden), module.in_proj_ba(hidden))
        mixed = torch.cat([x.reshape(bsz, n, -1) for x in (q, k, v)], dim=-1)
        return mixed, z, b, a
    z = module.in_proj_z(hidden).reshape(bsz, n, -1, module.head_v_dim)
    return module.in_proj_qkv(hidden), z, module.in_proj_b(hidden), module.in_proj_a(hidden)


def _activation(module: Any, x: torch.Tensor) -> torch.Tensor:
    from transformers.activations import ACT2FN

    return ACT2FN[getattr(module, "activation", "silu")](x)


def gdn_tree_forward(module: Any, hidden: torch.Tensor, plan: LinearTreePlan, cache: Any,
                     exact: bool = False) -> torch.Tensor:
    """The GDN layer's output for every tree node from its own root-to-node path; stashes the commit inputs.

    ``exact``: every node, chains and one-token steps included, takes one :func:`_delta_step` from its parent's
    state with the nodes of its depth as the batch, and the commit replays the same steps, so a node's state and
    output are a one-token step's bits."""
    bsz, n, _ = hidden.shape
    if (bsz, n) != (plan.batch, plan.num_nodes):
        raise ValueError(f"the tree has [{plan.batch}, {plan.num_nodes}] nodes but the GDN layer got {bsz}x{n} tokens")
    conv_state, state = _states(cache, module.layer_idx) if cache is not None else (None, None)
    if conv_state is None or state is None:
        raise ValueError("a tree forward through GDN layers needs a prefilled cache (run the prompt first, with "
                         "ddtree.blocks.new_target_cache(model))")
    mixed, z, b, a = _project(module, hidden)
    kernel = module.conv_kernel_size
    weight = module.conv1d.weight  # [C, 1, K]
    conv_inputs = mixed.transpose(1, 2)  # [B, C, N]
    ext = torch.cat([conv_state.to(weight.dtype), conv_inputs.to(weight.dtype)], dim=-1)  # [B, C, K + N]
    if plan.is_chain:  # node i's window is ext[i+1 : i+1+K]: a strided view, no gather
        windows = ext.unfold(2, kernel, 1)[:, :, 1:].transpose(1, 2)  # [B, N, C, K]
    else:
        index = plan.conv_index(kernel, ext.device)
        windows = ext.gather(2, index[:, None, :].expand(bsz, ext.shape[1], n * kernel))  # [B, C, N*K]
        windows = windows.view(bsz, -1, n, kernel).transpose(1, 2)  # [B, N, C, K]
    q, k, v, g, beta = _node_inputs(module, windows, b, a, hidden.dtype, exact)
    if exact:
        inputs = _normalised(q, k, v, g, beta, elementwise)
        _PENDING.setdefault(cache, {})[module.layer_idx] = _Pending(conv_inputs, *inputs, None)
        return _output(module, _exact_levels(inputs, plan, state).to(hidden.dtype), z)
    fn = _recurrent_fn(module)
    pending = _Pending(conv_inputs, q, k, v, g, beta, fn)
    _PENDING.setdefault(cache, {})[module.layer_idx] = pending

    if plan.is_chain and n >= CHUNKED_CHAIN_FROM:
        core = _run(_chunk_fn(module), q, k, v, g, beta, state, False)[0]
    else:
        core = _tree_recurrence(fn, pending, plan, state)  # [B, N, HV, Dv]
    return _output(module, core, z)


def _node_inputs(module: Any, windows: torch.Tensor, b: torch.Tensor, a: torch.Tensor, dtype: torch.dtype,
                 exact: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each node's recurrence inputs ``(q, k, v, g, beta)`` from its conv window ``[B, N, C, K]`` and gates
    (``exact``: the elementwise functions through :func:`~ddtree.runtime.invariant.elementwise`)."""
    if exact:
        return _node_inputs_with(module, windows, b, a, dtype, elementwise)
    return _node_inputs_with(module, windows, b, a, dtype, lambda fn, *xs: fn(*xs))


def _node_inputs_with(module: Any, windows: torch.Tensor, b: torch.Tensor, a: torch.Tensor, dtype: torch.dtype,
                      apply: Callable[..., torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    bsz, n = windows.shape[:2]
    weight = module.conv1d.weight  # [C, 1, K]
    conv = (windows * weight[:, 0]).sum(-1)  # the depthwise conv at each node's last tap: [B, N, C]
    if module.conv1d.bias is not None:  # (a multiply-sum: torch's depthwise conv1d is slow on few positions)
        conv = conv + module.conv1d.bias
    conv = apply(lambda x: _activation(module, x), conv).to(dtype)
    q, k, v = torch.split(conv, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q = q.reshape(bsz, n, -1, module.head_k_dim)
    k = k.reshape(bsz, n, -1, module.head_k_dim)
    v = v.reshape(bsz, n, -1, module.head_v_dim)
    group = module.num_v_heads // module.num_k_heads
    if group > 1:
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    beta = apply(torch.sigmoid, b)
    g = -module.A_log.float().exp() * apply(F.softplus, a.float() + module.dt_bias)
    return q, k, v, g, beta


def _output(module: Any, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The layer's gated norm and output projection of the recurrence outputs ``core`` ``[B, N, HV, Dv]``."""
    bsz, n = core.shape[:2]
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(bsz, n, -1))


def _run(fn: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
         beta: torch.Tensor, initial: torch.Tensor, final: bool) -> Any:
    return fn(q, k, v, g=g, beta=beta, initial_state=initial, output_final_state=final, use_qk_l2norm_in_kernel=True)


def _tree_recurrence(fn: Callable[..., Any], p: _Pending, plan: LinearTreePlan, state: torch.Tensor) -> torch.Tensor:
    """Per-node recurrence outputs: a chain in one call, a tree depth by depth from the parents' states.

    Where the layer's function is transformers' torch reference, each depth runs the same step in a
    few torch ops on inputs normalised once for all nodes (the per-call preparation of the reference
    loop would dominate a small tree); this is used only after a probe showed it reproduces the
    function bit for bit. Otherwise (the fla kernel, or another transformers' variant), each depth
    is one call of the layer's own function.
    """
    if plan.is_chain:
        return _run(fn, p.q, p.k, p.v, p.g, p.beta, state, False)[0]
    if _torch_step_matches(fn, p.q.dtype, p.q.device):
        return _levels_in_torch(p, plan, state)
    return _levels_with(fn, p, plan, state)


def _levels_with(fn: Callable[..., Any], p: _Pending, plan: LinearTreePlan, state: torch.Tensor) -> torch.Tensor:
    bsz, n = plan.batch, plan.num_nodes
    flat = [x.reshape(bsz * n, 1, *x.shape[2:]) for x in (p.q, p.k, p.v, p.g, p.beta)]
    out: torch.Tensor | None = None
    for ids, parent_slot in plan.levels:
        q, k, v, g, beta = (x.index_select(0, ids) for x in flat)
        o, state = _run(fn, q, k, v, g, beta, state.index_select(0, parent_slot), True)
        if out is None:
            out = o.new_empty(bsz * n, *o.shape[2:])
        out.index_copy_(0, ids, o[:, 0])
    assert out is not None  # a tree (not a chain) has levels
    return out.view(bsz, n, *out.shape[1:])


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _levels_in_torch(p: _Pending, plan: LinearTreePlan, state: torch.Tensor) -> torch.Tensor:
    """transformers' reference gated delta rule (float32, q/k l2-normalised, q scaled), one depth per step."""
    bsz, n = plan.batch, plan.num_nodes
    out_dtype = p.v.dtype
    flat = [x.reshape(bsz * n, *x.shape[2:]) for x in (p.q, p.k, p.v, p.g, p.beta)]
    q, k, v, decay, beta = _normalised(flat[0], flat[1], flat[2], flat[3], flat[4])
    state = state.to(torch.float32)
    out = v.new_empty(v.shape)  # [BN, HV, Dv]
    for ids, parent_slot in plan.levels:
        state, out[ids] = _delta_step(state.index_select(0, parent_slot), q[ids], k[ids], v[ids], decay[ids],
                                      beta[ids])
    return out.view(bsz, n, *out.shape[1:]).to(out_dtype)


def _exact_levels(inputs: tuple[torch.Tensor, ...], plan: LinearTreePlan, state: torch.Tensor) -> torch.Tensor:
    """Per-node recurrence outputs (float32) from :func:`_normalised` inputs, one depth per :func:`_delta_step`."""
    bsz, n = plan.batch, plan.num_nodes
    q, k, v, decay, beta = (x.reshape(bsz * n, *x.shape[2:]) for x in inputs)
    state = state.to(torch.float32)
    out = v.new_empty(v.shape)  # [BN, HV, Dv]
    for ids, parent_slot in plan.steps(q.device):
        state, out[ids] = _delta_step(state.index_select(0, parent_slot), q[ids], k[ids], v[ids], decay[ids],
                                      beta[ids])
    return out.view(bsz, n, *out.shape[1:])


def gdn_exact_step(module: Any, hidden: torch.Tensor, cache: Any) -> torch.Tensor:
    """A one-token step under exact numerics: the tree forward of each row's root alone, committed at once, so
    plain decoding computes every state and output as a tree node does."""
    out = gdn_tree_forward(module, hidden, LinearTreePlan.root_only(hidden.shape[0], hidden.device), cache, True)
    pending = _PENDING[cache].pop(module.layer_idx)
    _commit_layer(cache, module.layer_idx, pending, torch.zeros(hidden.shape[0], 1, dtype=torch.long))
    layers = getattr(cache, "layers", None)
    count = getattr(layers[module.layer_idx], "cumulative_length_linear", None) if layers is not None else None
    if isinstance(count, torch.Tensor):  # transformers 5.25+ counts a linear layer's tokens, as its own step would
        count.add_(1)
    return out


def _normalised(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                apply: Callable[..., torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The recurrence inputs as transformers' reference rule uses them: float32, q and k l2-normalised, q scaled
    by the head size, and the decay ``exp(g)``."""
    q, k, v, g, beta = (x.to(torch.float32) for x in (q, k, v, g, beta))
    q = _l2norm(q)
    k = _l2norm(k)
    return q / (q.shape[-1] ** 0.5), k, v, g.exp() if apply is None else apply(torch.exp, g), beta


def _delta_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One gated-delta step of transformers' reference rule for a batch of nodes (any leading dims): each
    node's state ``[..., HV, Dk, Dv]`` after its input, and its output ``[..., HV, Dv]`` (inputs from
    :func:`_normalised`)."""
    s = state * decay[..., None, None]
    kv_mem = (s * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - kv_mem) * beta[..., None]
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return s, (s * q.unsqueeze(-1)).sum(dim=-2)


_PROBED: dict = {}


def _torch_step_matches(fn: Callable[..., Any], dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :func:`_levels_in_torch` equals ``fn`` exactly (outputs and states) on a small random case."""
    key = (fn, dtype, str(device))
    if key not in _PROBED:
        gen = torch.Generator().manual_seed(0)
        rand = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
        bsz, heads, dim = 3, 2, 8
        p = _Pending(torch.empty(0), rand(bsz, 1, heads, dim), rand(bsz, 1, heads, dim), rand(bsz, 1, heads, dim),
                     -rand(bsz, 1, heads).abs().float(), rand(bsz, 1, heads).sigmoid(), fn)
        state = torch.randn(bsz, heads, dim, dim, generator=gen).to(device)
        plan = LinearTreePlan(bsz, 1, np.full((bsz, 1), -1), np.zeros((bsz, 1), dtype=np.int64),
                              [(torch.arange(bsz, device=device), torch.arange(bsz, device=device))], False)
        try:
            want = _run(fn, p.q, p.k, p.v, p.g, p.beta, state, True)[0]
            _PROBED[key] = torch.equal(_levels_in_torch(p, plan, state), want)
        except Exception:  # a kernel that cannot run this probe: use it as it is
            _PROBED[key] = False
    return _PROBED[key]


# --------------------------------------------------------------------------- the static (compiled) round


def tree_conv_index(parents: torch.Tensor, depths: torch.Tensor, kernel: int) -> torch.Tensor:
    """:meth:`LinearTreePlan.conv_index` in tensor ops (a compiled step builds it, reading nothing back):
    ``[B, N*K]`` indices into ``[cached window (K) | tree inputs (N)]``, each node's window oldest first."""
    bsz, n = parents.shape
    up = parents.clamp(min=0)
    node = torch.arange(n, device=parents.device).expand(bsz, n)  # walks up one ancestor per step back
    taps = []
    for back in range(kernel):  # the input `back` steps before each node
        taps.append(torch.where(back <= depths, kernel + node, kernel - (back - depths)))
        node = torch.where(back < depths, up.gather(1, node), node)
    return torch.stack(taps[::-1], dim=-1).reshape(bsz, n * kernel)


@dataclass
class StaticPending:
    """A static verify's per-node inputs in fixed buffers (overwritten by each verify, read by its commit):
    the raw conv inputs and the recurrence inputs as :func:`_normalised` gives them."""

    conv_inputs: torch.Tensor  # [B, C, N], the conv window's dtype
    q: torch.Tensor  # [B, N, HV, Dk] float32
    k: torch.Tensor
    v: torch.Tensor  # [B, N, HV, Dv] float32
    decay: torch.Tensor  # [B, N, HV] float32
    beta: torch.Tensor  # [B, N, HV] float32

    @classmethod
    def empty(cls, conv: torch.Tensor, state: torch.Tensor, nodes: int) -> StaticPending:
        """Buffers for ``nodes`` tree nodes next to a layer's conv window ``[B, C, K]`` and state
        ``[B, HV, Dk, Dv]``."""
        bsz, heads, dk, dv = state.shape

        def f32(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.float32, device=state.device)

        return cls(conv.new_zeros(bsz, conv.shape[1], nodes), f32(bsz, nodes, heads, dk), f32(bsz, nodes, heads, dk),
                   f32(bsz, nodes, heads, dv), f32(bsz, nodes, heads), f32(bsz, nodes, heads))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.conv_inputs, self.q, self.k, self.v, self.decay, self.beta)


def static_tree_forward(module: Any, hidden: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor,
                        pending: StaticPending, parents: torch.Tensor, depths: torch.Tensor, conv_index: torch.Tensor,
                        max_depth: int) -> torch.Tensor:
    """:func:`gdn_tree_forward` in fixed shapes, for the static round: the same conv windows (gathered by
    :func:`tree_conv_index`) and the same per-node recurrence, run for every node at each depth ``0 ..
    max_depth`` from its parent's state (the committed state at depth 0) and kept where the node has that
    depth, so each node's state is exactly one :func:`_delta_step` from its parent's (``max_depth + 1`` steps
    of ``N`` nodes where the dynamic round takes ``N``: the price of shapes that never depend on the tree).
    The committed state is not written: the per-node inputs go to ``pending`` in place, for
    :func:`static_commit`'s replay."""
    bsz, n, _ = hidden.shape
    mixed, z, b, a = _project(module, hidden)
    kernel = conv_state.shape[-1]
    weight = module.conv1d.weight
    conv_inputs = mixed.transpose(1, 2)  # [B, C, N]
    ext = torch.cat([conv_state.to(weight.dtype), conv_inputs.to(weight.dtype)], dim=-1)  # [B, C, K + N]
    windows = ext.gather(2, conv_index[:, None, :].expand(bsz, ext.shape[1], n * kernel))
    windows = windows.view(bsz, -1, n, kernel).transpose(1, 2)  # [B, N, C, K]
    q, k, v, g, beta = _node_inputs(module, windows, b, a, hidden.dtype)
    inputs = _normalised(q, k, v, g, beta)
    for buf, x in zip(pending.tensors(), (conv_inputs, *inputs)):
        buf.copy_(x)
    q, k, v, decay, beta = inputs
    shape = (bsz, n, *state.shape[1:])
    committed = state.to(torch.float32)[:, None].expand(shape)
    up = parents.clamp(min=0).view(bsz, n, 1, 1, 1).expand(shape)
    states, out = committed, torch.zeros_like(v)
    for depth in range(max_depth + 1):
        s, o = _delta_step(states.gather(1, up) if depth else committed, q, k, v, decay, beta)
        here = depths == depth
        states = torch.where(here.view(bsz, n, 1, 1, 1), s, states)
        out = torch.where(here.view(bsz, n, 1, 1), o, out)
    return _output(module, out.to(hidden.dtype), z)


def static_commit(conv_state: torch.Tensor, state: torch.Tensor, pending: StaticPending, accepted: torch.Tensor,
                  alive: torch.Tensor) -> None:
    """:func:`commit_linear_states` in fixed shapes, in place: each live row's state becomes its last accepted
    node's, replayed from the committed state over the ``L`` columns of ``accepted`` (``[B, L]``, ``-1`` past
    a row's path: those steps leave the state as it is), and its conv window the last ``K`` inputs along its
    path (topped up from the old window). Finished rows (``alive`` False) keep theirs."""
    bsz, length = accepted.shape
    count = (accepted >= 0).sum(dim=1)
    path = accepted.clamp(min=0)
    channels, kernel = conv_state.shape[1:]
    along = pending.conv_inputs.gather(2, path[:, None, :].expand(bsz, channels, length)).to(conv_state.dtype)
    ext = torch.cat([conv_state, along], dim=-1)  # [B, C, K + L]: the window ends at the last accepted input
    last = count[:, None] + torch.arange(kernel, device=accepted.device)
    window = ext.gather(2, last[:, None, :].expand(bsz, channels, kernel))
    s = state.to(torch.float32)
    for step in range(length):
        node = path[:, step]
        picked = [x.gather(1, node.view(bsz, *[1] * (x.dim() - 1)).expand(bsz, 1, *x.shape[2:]))[:, 0]
                  for x in (pending.q, pending.k, pending.v, pending.decay, pending.beta)]
        s = torch.where((step < count).view(bsz, 1, 1, 1), _delta_step(s, *picked)[0], s)
    conv_state.copy_(torch.where(alive.view(bsz, 1, 1), window, conv_state))
    state.copy_(torch.where(alive.view(bsz, 1, 1, 1), s.to(state.dtype), state))


class StaticLinearLayer:
    """One GDN layer in the static round: each row's committed conv window ``[B, C, K]`` and recurrent state
    ``[B, HV, Dk, Dv]`` in fixed buffers, and the last verify's per-node inputs (:class:`StaticPending`), which
    the commit replays instead of keeping a state per node (a state is ``HV * Dk * Dv`` numbers, a node's
    inputs ``HV * (2 * Dk + Dv + 2)``: about 40 times fewer at Qwen3.6's ``Dk = Dv = 128``). It sits at its
    index in the row-packed cache, where the patched GDN forward finds it."""

    runs_static_tree = True  # what the patched GDN forward looks for in its cache
    is_sliding = False
    is_compileable = True

    def __init__(self, group: StaticLinearStates, conv: torch.Tensor, state: torch.Tensor) -> None:
        self.group = group
        self.conv, self.state = conv, state
        self.pending: StaticPending | None = None

    def reserve_nodes(self, nodes: int) -> None:
        if self.pending is None or self.pending.q.shape[1] != nodes:
            self.pending = StaticPending.empty(self.conv, self.state, nodes)
            for buf in self.pending.tensors():
                torch._dynamo.mark_static_address(buf)  # written in place by the verify step

    def tree_forward(self, module: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        group = self.group
        if self.pending is None or group.parents is None or group.depths is None or group.conv_index is None:
            raise RuntimeError("a static GDN forward needs reserve_nodes and set_tree first (the static round's "
                               "verify step calls them)")
        return static_tree_forward(module, hidden, self.conv, self.state, self.pending, group.parents, group.depths,
                                   group.conv_index, group.max_depth)

    def commit(self, accepted: torch.Tensor, alive: torch.Tensor) -> None:
        assert self.pending is not None  # a verify ran
        static_commit(self.conv, self.state, self.pending, accepted, alive)


class StaticLinearStates:
    """A cache's GDN layers in the static round (the :class:`~ddtree.targets.layer_kinds.StaticStates` of
    :class:`GatedDeltaNet`): one :class:`StaticLinearLayer` per layer index, and the tree they share (each node's
    conv-window index is gathered once per verify, for every layer)."""

    def __init__(self, states: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        for conv, state in states.values():
            torch._dynamo.mark_static_address(conv)  # the steps write them in place
            torch._dynamo.mark_static_address(state)
        self.layers = {idx: StaticLinearLayer(self, conv, state) for idx, (conv, state) in sorted(states.items())}
        self.parents: torch.Tensor | None = None
        self.depths: torch.Tensor | None = None
        self.conv_index: torch.Tensor | None = None
        self.max_depth = 0

    @classmethod
    def from_cache(cls, cache: Any) -> StaticLinearStates:
        """Copies of each GDN layer's committed conv window and state in ``cache`` (each row its own prefill's)."""
        states = {}
        for idx in _linear_layer_ids(cache):
            conv, state = _committed_states(cache, idx)
            states[idx] = (conv.clone(), state.clone())
        return cls(states)

    def reserve_nodes(self, nodes: int) -> None:
        for layer in self.layers.values():
            layer.reserve_nodes(nodes)

    def set_tree(self, parents: torch.Tensor, depths: torch.Tensor, max_depth: int) -> None:
        self.parents, self.depths, self.max_depth = parents, depths, max_depth
        if self.layers:
            kernel = next(iter(self.layers.values())).conv.shape[-1]
            self.conv_index = tree_conv_index(parents, depths, kernel)

    def commit(self, accepted: torch.Tensor, alive: torch.Tensor) -> None:
        for layer in self.layers.values():
            layer.commit(accepted, alive)


# --------------------------------------------------------------------------- commit


def has_pending(cache: Any) -> bool:
    return bool(_pending(cache))


def drop_pending(cache: Any) -> None:
    """Forget a verify forward's per-node inputs: its tree is discarded, the committed state stays."""
    if cache is not None:
        _PENDING.pop(cache, None)


def commit_linear_states(cache: Any, accepted: torch.Tensor) -> None:
    """Install, per row, the recurrent state of its last accepted node and the conv window along its path.

    ``accepted`` is ``[B, L]`` node indices root first, ``-1`` padding where a row accepted
    fewer nodes (ragged batches). Replays each row's path from its committed state with the
    inputs the verify forward stashed, then clears the pending slot.
    """
    pending: dict[int, _Pending] = _PENDING.pop(cache, None) or {}
    for idx, p in pending.items():
        _commit_layer(cache, idx, p, accepted)


def _commit_layer(cache: Any, idx: int, p: _Pending, accepted: torch.Tensor) -> None:
    """:func:`commit_linear_states` for GDN layer ``idx``."""
    conv_state, state = _committed_states(cache, idx)
    rows_conv, rows_state = [], []
    for row in range(accepted.shape[0]):
        path = accepted[row][accepted[row] >= 0].to(p.q.device)
        kernel = conv_state.shape[-1]
        window = torch.cat([conv_state[row], p.conv_inputs[row].index_select(-1, path).to(conv_state.dtype)], -1)
        rows_conv.append(window[:, -kernel:])
        if path.numel() == 0:
            rows_state.append(state[row])
            continue
        q, k, v, g, beta = (x[row : row + 1].index_select(1, path) for x in (p.q, p.k, p.v, p.g, p.beta))
        if p.fn is None:  # exact: the tree forward's own steps, one node at a time
            s = state[row : row + 1].to(torch.float32)
            for i in range(path.numel()):
                s = _delta_step(s, q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i])[0]
            rows_state.append(s[0].to(state.dtype))
        else:
            rows_state.append(_run(p.fn, q, k, v, g, beta, state[row : row + 1], True)[1][0].to(state.dtype))
    _set_states(cache, idx, torch.stack(rows_conv), torch.stack(rows_state))


# --------------------------------------------------------------------------- batch rows


def has_linear_layers(cache: Any) -> bool:
    """Whether ``cache`` has linear-attention slots (filled or not)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return any(c is not None for c in getattr(cache, "conv_states", []))
    return any(hasattr(layer, "recurrent_states") for layer in layers)


def _linear_layer_ids(cache: Any) -> list[int]:
    """Indices of the GDN layers of ``cache`` that hold a committed state."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [i for i, layer in enumerate(layers)
                if hasattr(layer, "recurrent_states") and layer.recurrent_states[0] is not None]
    return [i for i, conv in enumerate(getattr(cache, "conv_states", None) or []) if conv is not None]


def stack_linear_states(caches: list[Any], into: Any) -> None:
    """Give ``into`` the GDN states of every cache in ``caches`` (batch-1 each), stacked in that order.

    GDN states are per row, not per column: a row's state is exactly its own prefill's, whatever
    the other rows' lengths.
    """
    for idx in _linear_layer_ids(into):
        convs, states = zip(*(_states(c, idx) for c in caches))
        _set_states(into, idx, torch.cat(convs), torch.cat(states))


def select_linear_rows(cache: Any, rows: torch.Tensor) -> None:
    """Keep only batch rows ``rows`` of every GDN layer's conv window and recurrent state (and any
    uncommitted tree inputs), so a finished row's state never reaches a remaining row."""
    for idx in _linear_layer_ids(cache):
        conv, state = _committed_states(cache, idx)
        _set_states(cache, idx, conv.index_select(0, rows.to(conv.device)),
                    state.index_select(0, rows.to(state.device)))
    pending: dict[int, _Pending] = _pending(cache)
    for idx, p in pending.items():
        pick = lambda x: x.index_select(0, rows.to(x.device))  # noqa: E731
        pending[idx] = _Pending(pick(p.conv_inputs), pick(p.q), pick(p.k), pick(p.v), pick(p.g), pick(p.beta), p.fn)


# --------------------------------------------------------------------------- installing on a model


@dataclass
class _Context:
    """What the top-level forward hands its GDN layers for one call (None outside tree forwards)."""

    plan: LinearTreePlan | None = None
    cache: object = None
    exact: bool = False  # numerics="exact": one-token steps run as root-only trees (gdn_exact_step)


def _gdn_forward(self: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    ctx: _Context = self._ddtree_context
    if ctx.plan is not None:
        return gdn_tree_forward(self, hidden_states, ctx.plan, ctx.cache, ctx.exact)
    if ctx.exact and hidden_states.shape[1] == 1 and not in_bulk():
        cache = next((kwargs[k] for k in _CACHE_KEYWORDS if kwargs.get(k) is not None), None)
        if cache is not None and _states(cache, self.layer_idx)[1] is not None:
            return gdn_exact_step(self, hidden_states, cache)
    static = _static_layer(kwargs, self.layer_idx)
    if static is not None:  # the static round's verify: its cache carries the tree and this layer's buffers
        return static.tree_forward(self, hidden_states)
    return self._ddtree_original_forward(hidden_states, *args, **kwargs)


_CACHE_KEYWORDS = ("cache", "past_key_values", "cache_params")


def _static_layer(kwargs: dict[str, Any], idx: int) -> Any:
    """Layer ``idx`` of the forward's cache when it runs static tree forwards (the static round's
    :class:`~ddtree.targets.static_cache.RowPackedCache`), else None."""
    cache = next((kwargs[k] for k in _CACHE_KEYWORDS if kwargs.get(k) is not None), None)
    layers = getattr(cache, "layers", None)
    layer = layers[idx] if isinstance(layers, list) and idx < len(layers) else None
    return layer if getattr(layer, "runs_static_tree", False) else None


def _model_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    tree = kwargs.pop(LINEAR_TREE_KWARG, None)
    ctx: _Context = self._ddtree_context
    if tree is None:
        return self._ddtree_original_forward(*args, **kwargs)
    cache = next((kwargs[k] for k in _CACHE_KEYWORDS if kwargs.get(k) is not None), None)
    if cache is None:
        raise ValueError("a tree forward through GDN layers needs the target cache (pass it with "
                         "ddtree.targets.cache.cache_kwargs)")
    _PENDING[cache] = {}
    ctx.plan = tree if isinstance(tree, LinearTreePlan) else LinearTreePlan.from_tree(tree)
    ctx.cache = cache
    try:
        return self._ddtree_original_forward(*args, **kwargs)
    finally:
        ctx.plan, ctx.cache = None, None


def is_prepared(model: Any) -> bool:
    return "_ddtree_context" in vars(model)


def prepare(model: Any, exact: bool = False) -> bool:
    """Route ``model``'s GDN layers through the tree-aware forward (idempotent); False when it has none.
    ``exact``: one-token steps too (:func:`gdn_exact_step`), and every recurrence as :func:`_delta_step`."""
    modules = gdn_modules(model)
    if not modules:
        return False
    if is_prepared(model):
        model._ddtree_context.exact = exact
        return True
    ctx = _Context(exact=exact)
    patched: list[Any] = [*modules, model]
    for m in patched:
        m._ddtree_original_forward = m.forward
        m._ddtree_context = ctx
        m.forward = _keeping_signature(m, _model_forward if m is model else _gdn_forward)
    return True


def _keeping_signature(module: Any, replacement: Callable[..., Any]) -> Callable[..., Any]:
    """``replacement`` bound to ``module``, with the signature of the forward it replaces: HF ``generate``
    reads the forward's parameters (a target whose forward seemed not to take ``logits_to_keep`` got the
    prompt's every logits row computed by a later HF ``generate``)."""

    @functools.wraps(module.forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return replacement(module, *args, **kwargs)

    return forward


def unprepare(model: Any) -> None:
    """Undo :func:`prepare`: the instances get their class forwards back."""
    for m in [model, *gdn_modules(model)]:
        for name in ("forward", "_ddtree_original_forward", "_ddtree_context"):
            m.__dict__.pop(name, None)


# --------------------------------------------------------------------------- the layer kind


def chunk_continues_state() -> bool:
    """Whether transformers' GDN forward continues the cached state over a multi-token input: it does in 5.15
    and 5.24 (the chunked rule starts from the cached state). Older releases are not checked (Qwen3-Next's
    first GDN forward restarted from zero), so a hybrid target prefills in one forward there."""
    import transformers

    return tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2]) >= (5, 15)


class GatedDeltaNet:
    """Gated DeltaNet layers as a :class:`ddtree.targets.layer_kinds.StatefulLayerKind`."""

    name: str = "Gated DeltaNet"
    model_types: tuple[str, ...] = GDN_MODEL_TYPES
    padded_prefill_exact: bool = False
    """transformers zeroes the pad inputs of a left-padded batch, but its chunked gated-delta rule still decays
    the state through them (float64, 57 pads: a row's last logits 2e-7 off its own prefill's)."""
    prefill_multiple: int = GDN_CHUNK

    def modules(self, model: Any) -> list[torch.nn.Module]:
        return gdn_modules(model)

    def prefill_continues_state(self) -> bool:
        return chunk_continues_state()

    def new_cache(self, model: Any) -> Any:
        return new_hybrid_cache(model)

    def prepare(self, model: Any, exact: bool = False) -> None:
        prepare(model, exact)

    def release(self, model: Any) -> None:
        unprepare(model)

    def tree_forward_kwargs(self, model: Any, tree: DraftTree) -> dict[str, Any]:
        return {LINEAR_TREE_KWARG: tree} if is_prepared(model) else {}

    def holds_state(self, cache: Any) -> bool:
        return has_linear_layers(cache)

    def commit(self, cache: Any, accepted: torch.Tensor) -> None:
        if has_pending(cache):
            commit_linear_states(cache, accepted)  # per row, from each row's own last accepted node
        elif has_linear_layers(cache):
            raise ValueError(
                "the target cache has linear-attention (GDN) layers but the verify forward left no per-node "
                "state: transformers' own GDN forward would have mixed sibling nodes. Prepare the target with "
                "ddtree.targets.linear_attention.prepare(model) and pass the backend's tree_forward_kwargs "
                "(SpeculativeGenerator does)"
            )

    def drop_pending(self, cache: Any) -> None:
        drop_pending(cache)

    def select_rows(self, cache: Any, rows: torch.Tensor) -> None:
        select_linear_rows(cache, rows)

    def stack_rows(self, caches: list[Any], into: Any) -> None:
        stack_linear_states(caches, into)

    def static_states(self, cache: Any) -> StaticLinearStates:
        return StaticLinearStates.from_cache(cache)
