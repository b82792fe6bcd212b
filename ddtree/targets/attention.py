"""Attention backends for the target's tree-verify forward.

A backend turns a :class:`~ddtree.core.tree.DraftTree` into the extra keyword
arguments of one HF forward call. ``prepare(model)`` is called once per target.

- ``"sdpa"``: a dense additive ``[B, 1, N, prefix + N]`` mask; any HF attention
  implementation that accepts a 4D mask runs it.
- ``"split"``, ``"fused"``, ``"flash_attn"``: split attention (see
  :mod:`ddtree.targets.split_attention`). The committed prefix is attended with no mask
  by a kernel that returns the log-sum-exp, the tree block with its small dense
  mask, and the two are merged exactly. They differ only in the prefix kernel:
  plain torch (the reference), PyTorch's fused flash/memory-efficient kernels
  (CPU and CUDA, no extra package), or the flash-attn package (CUDA).
- ``"auto"``: ``flash_attn`` on CUDA when the package imports, else ``fused``;
  on the CPU ``fused``, but with the dense mask while the prefix is under
  1024 tokens, where the dense mask measured faster (see docs/attention.md).

The split backends are transformers attention implementations registered with
``AttentionInterface`` under ``ddtree_split``, ``ddtree_fused`` and ``ddtree_fa``
(no "flash" in the names: transformers special-cases those). A model set to
one of them runs ordinary causal attention (with its sliding window) when no
tree is passed, so prefill and decode need nothing else.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import weakref
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from ddtree.core.masks import tree_attention_mask
from ddtree.core.tree import DraftTree
from ddtree.targets.split_attention import (
    BlockKernel,
    PrefixKernel,
    attention_with_lse,
    compute_dtype,
    fold_gqa,
    merge_attention,
    split_tree_attention,
    torch_prefix_kernel,
    tree_block_allowed,
    unfold_gqa,
    window_split,
)

TREE_KWARG = "ddtree_tree"


"""Name of the forward kwarg that carries a :class:`TreeAttentionSpec` down to the attention function."""


_MASK_CHUNK_ELEMENTS = 1 << 24  # causal masks are built in query chunks of at most this many entries


@functools.cache
def flash_attn_available() -> bool:
    """True when the flash-attn package imports (it only ever runs on CUDA); a broken install counts as absent."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        from flash_attn import flash_attn_func, flash_attn_with_kvcache  # noqa: F401
    except Exception:
        return False
    return True


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


_WINDOWS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def attention_windows(model) -> dict[int, int | None]:
    """``{layer_idx: sliding window or None}`` for every softmax-attention layer of ``model``.

    Read from the model itself, most specific first, because families set windows in
    different places: an attention module's own ``sliding_window`` attribute (Qwen2/3,
    Gemma 2/3, Cohere2, gpt-oss), else the config's ``layer_types`` with its
    ``sliding_window`` (``"sliding_attention"`` layers), else a config-level
    ``sliding_window`` that applies to every layer (Mistral, Mixtral). Linear-attention
    layers are left out. Memoised per model (the walk runs once, not every round).
    """
    if model in _WINDOWS:
        return _WINDOWS[model]
    cfg = _text_config(model.config)
    types = list(getattr(cfg, "layer_types", None) or [])
    config_window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", True) is False:
        config_window = None
    own: dict[int, int | None] = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and "sliding_window" in vars(module) and not _is_linear_type(types, idx):
            own[idx] = vars(module)["sliding_window"]
    windows: dict[int, int | None] = {}
    for idx in range(getattr(cfg, "num_hidden_layers", len(types))):
        if _is_linear_type(types, idx):
            continue
        if idx in own:
            window = own[idx]
        elif types:
            if types[idx] not in ("full_attention", "sliding_attention"):
                raise ValueError(f"layer {idx} is a {types[idx]!r} layer, which ddtree cannot verify as a tree")
            window = config_window if types[idx] == "sliding_attention" else None
        else:
            window = config_window
        windows[idx] = int(window) if window else None
    _WINDOWS[model] = windows
    return windows


def _is_linear_type(types, idx: int) -> bool:
    return idx < len(types) and types[idx] == "linear_attention"


def _sliding_window(config) -> int | None:
    """The config's sliding window when some layer uses it (kept for callers that only have a config)."""
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    if not layer_types or any(t == "sliding_attention" for t in layer_types):
        return int(window)
    return None


def has_attention_sinks(model) -> bool:
    """True when an attention layer has learned sinks (gpt-oss ``s_aux``), which split attention does not run."""
    return any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules())


def dense_tree_mask(model, tree: DraftTree, prefix_len: int, dtype: torch.dtype,
                    prefix_valid: torch.Tensor | None = None):
    """The dense additive tree mask for ``model``: one tensor when every attention layer has the same window,
    else a dict keyed by the config's layer types (how HF models take per-layer-kind masks).
    ``prefix_valid`` hides a batch's padding columns (see :func:`ddtree.core.masks.tree_attention_mask`)."""
    windows = attention_windows(model)
    kinds = set(windows.values())

    def mask(window):
        return tree_attention_mask(tree.visibility, prefix_len, dtype, sliding_window=window, depths=tree.depths,
                                   prefix_valid=prefix_valid)

    if len(kinds) <= 1:
        return mask(next(iter(kinds), None))
    types = list(getattr(_text_config(model.config), "layer_types", None) or [])
    by_type: dict[str, int | None] = {}
    for idx, window in windows.items():
        kind = types[idx] if idx < len(types) else None
        if kind is None or by_type.setdefault(kind, window) != window:
            raise ValueError(
                f"{type(model).__name__} has attention layers with different windows that its config's layer_types "
                "do not separate, so one dense mask per layer kind cannot express them; use attention=\"split\""
            )
    masks = {kind: mask(window) for kind, window in by_type.items()}
    for kind in set(types) - set(masks):
        masks[kind] = None  # linear-attention layers take no attention mask
    return masks


@dataclass(eq=False)
class TreeAttentionSpec:
    """What the attention function needs about the tree, built once per verify forward.

    ``max_depth`` is a host int so no layer has to sync the device. Block masks
    are memoised per ``(prefix_len, window)`` so sliding and full layers each
    build theirs once per forward, not once per layer.
    """

    visibility: torch.Tensor  # [B, N, N] bool, ancestor-or-self
    depths: torch.Tensor  # [B, N] long
    max_depth: int
    _blocks: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_tree(cls, tree: DraftTree) -> "TreeAttentionSpec":
        return cls(tree.visibility.bool(), tree.depths, tree.max_depth)

    @property
    def num_nodes(self) -> int:
        return self.visibility.shape[-1]

    def block(self, prefix_len: int, window: int | None, device: torch.device) -> tuple[int, int, torch.Tensor]:
        """``(band_start, common_start, allowed)`` for one layer kind; see :func:`window_split`."""
        key = (prefix_len, window, str(device))
        if key not in self._blocks:
            band_start, common_start = window_split(prefix_len, self.max_depth, window)
            allowed = tree_block_allowed(
                self.visibility.to(device), self.depths.to(device), prefix_len, band_start, common_start, window
            )
            self._blocks[key] = (band_start, common_start, allowed)
        return self._blocks[key]


def fused_prefix_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """PyTorch's own fused kernels with LSE: flash on CPU; flash (half types) or memory-efficient on CUDA.

    GQA is handled by folding query heads into rows, so keys are never repeated.
    """
    hq, hkv = q.shape[1], k.shape[1]
    qf = fold_gqa(q, hkv).contiguous()
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qf, k, v, 0.0, False, scale=scale)
    elif q.device.type == "cuda":
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
        d = q.shape[-1]
        if q.dtype in (torch.float16, torch.bfloat16) and d <= 256 and d % 8 == 0:
            res = torch.ops.aten._scaled_dot_product_flash_attention(qf, k, v, 0.0, False, False, scale=scale)
        else:
            res = torch.ops.aten._scaled_dot_product_efficient_attention(qf, k, v, None, True, 0.0, False, scale=scale)
        out, lse = res[0], res[1][..., : qf.shape[2]]  # the efficient kernel pads its LSE rows
    else:
        raise RuntimeError(f"the fused prefix kernel runs on CPU or CUDA, not {q.device.type}")
    return unfold_gqa(out, hq), unfold_gqa(lse, hq)


def fused_block_kernel(q, k, v, scale, allowed):
    """The masked tree block: PyTorch's CPU flash kernel takes a mask and returns the LSE; elsewhere plain torch.

    (On CUDA the block is small next to the prefix, and the fused CUDA kernels
    that take a mask have alignment rules; plain torch is exact and cheap there.)
    """
    if q.device.type != "cpu":
        return attention_with_lse(q, k, v, scale, allowed)
    hq, hkv = q.shape[1], k.shape[1]
    cdt = compute_dtype(q.dtype)  # the block is small: keep it in float32 so bf16 rounds only once, at the end
    additive = torch.zeros(allowed.shape, dtype=cdt).masked_fill_(~allowed, float("-inf"))
    additive = additive[:, None].repeat(1, 1, hq // hkv, 1)  # folded rows are group-major: row = g * N + n
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        fold_gqa(q.to(cdt), hkv).contiguous(), k.to(cdt), v.to(cdt), 0.0, False, attn_mask=additive, scale=scale
    )
    return unfold_gqa(out, hq), unfold_gqa(lse, hq)


def flash_attn_prefix_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """flash-attn's kv-cache kernel with ``return_softmax_lse``; float32 inputs go to the fused kernel."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return fused_prefix_kernel(q, k, v, scale)
    from flash_attn import flash_attn_with_kvcache

    out, lse = flash_attn_with_kvcache(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        softmax_scale=scale, causal=False, return_softmax_lse=True,
    )
    return out.transpose(1, 2), lse


def _key_padding(attention_mask, batch: int, kv_len: int, device) -> torch.Tensor | None:
    """Bool ``[B, S]`` of real keys from a 2D HF padding mask, or None when nothing is padded."""
    if attention_mask is None:
        return None
    keep = attention_mask.to(device=device).bool()
    if keep.shape != (batch, kv_len):
        raise ValueError(f"2D attention mask must be [batch, kv_len] = [{batch}, {kv_len}], got {tuple(keep.shape)}")
    return None if bool(keep.all()) else keep


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    key_padding: torch.Tensor | None = None,
    use_flash_attn: bool = False,
    dropout: float = 0.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention with the queries as the last ``L`` of ``S`` keys (HF cache alignment).

    Query ``i`` sits at position ``S - L + i`` and sees keys ``j <= S - L + i``,
    and with a window only ``j > S - L + i - window``, the rule of HF sliding
    layers. Logit soft-capping (Gemma 2) runs in plain torch. Returns ``[B, Hq, L, D]``.
    """
    bsz, hq, q_len, _ = q.shape
    kv_len, hkv = k.shape[2], k.shape[1]
    gqa = hq != hkv
    if window is not None and window >= kv_len:
        window = None  # no key is ever that far away
    if (
        use_flash_attn and key_padding is None and softcap is None and q.device.type == "cuda"
        and q.dtype in (torch.float16, torch.bfloat16)
    ):
        from flash_attn import flash_attn_func

        out = flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout, softmax_scale=scale,
            causal=True, window_size=(window - 1, 0) if window is not None else (-1, -1),
        )
        return out.transpose(1, 2)
    if window is None and key_padding is None and softcap is None and (q_len == 1 or q_len == kv_len):
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=q_len > 1, scale=scale, enable_gqa=gqa
        )
    if window is None and key_padding is None and softcap is None and not dropout and q.device.type == "cpu":
        return cached_chunk_attention(q, k, v, scale)
    offset = kv_len - q_len
    rows = max(1, _MASK_CHUNK_ELEMENTS // max(kv_len, 1))
    key_pos = torch.arange(kv_len, device=q.device)
    outs = []
    for start in range(0, q_len, rows):
        q_pos = offset + torch.arange(start, min(q_len, start + rows), device=q.device)
        dist = q_pos[:, None] - key_pos[None, :]
        allowed = dist >= 0
        if window is not None:
            allowed &= dist < window
        allowed = allowed.expand(bsz, -1, -1)
        if key_padding is not None:
            # A padded query still sees itself, so no row is empty (an empty row would give NaN).
            allowed = (allowed & key_padding[:, None, :]) | (dist == 0)
        q_rows = q[:, :, start : start + rows]
        if softcap is not None:
            outs.append(attention_with_lse(q_rows, k, v, scale, allowed, softcap)[0].to(q.dtype))
            continue
        outs.append(
            F.scaled_dot_product_attention(
                q_rows, k, v, attn_mask=allowed[:, None], dropout_p=dropout, scale=scale, enable_gqa=gqa
            )
        )
    return torch.cat(outs, dim=2)


def cached_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of an ``L``-query prefill chunk over ``S > L`` keys, the chunk's own last, on a CPU.

    The cached ``S - L`` keys are seen by every query (no mask) and the chunk's keys causally (a square, so
    the kernel's own causal flag is the right alignment); PyTorch's CPU flash kernel attends each with its
    LSE and the two merge exactly. No ``[L, S]`` mask is built: a 4096-token chunk after 12k cached tokens
    would otherwise carry a 200 MB float mask, and the masked kernel visits every masked block.
    """
    hq, hkv, q_len = q.shape[1], k.shape[1], q.shape[2]
    cached = k.shape[2] - q_len
    o1, l1 = fused_prefix_kernel(q, k[:, :, :cached], v[:, :, :cached], scale)
    group = hq // hkv
    o2, l2 = torch.empty_like(o1), torch.empty_like(l1)
    kb, vb = k[:, :, cached:], v[:, :, cached:]
    for g in range(group):  # query heads g, g + G, ... read key heads 0, 1, ...: no key is repeated
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[:, g::group].contiguous(), kb, vb, 0.0, True, scale=scale)
        o2[:, g::group], l2[:, g::group] = out, lse
    return merge_attention(o1, l1, o2, l2, inplace=True)[0].to(q.dtype)


def _make_attention_function(prefix_kernel: PrefixKernel, block_kernel: BlockKernel | None, use_flash_attn: bool):
    """A transformers attention function: split tree attention when a tree is passed, causal otherwise."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                  softcap=None, **kwargs):
        if kwargs.get("s_aux") is not None:
            raise ValueError("ddtree split attention does not support attention sinks (s_aux): use attention=\"sdpa\" for this target")
        scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
        window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
        spec = kwargs.get(TREE_KWARG)
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
            if spec is not None:
                raise ValueError("pass either a tree spec or a dense 4D mask to the forward, not both")
            # A ready dense mask (the "sdpa" backend's kwargs): run it as sdpa would.
            out = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask.to(query.device), dropout_p=dropout, scale=scale,
                enable_gqa=query.shape[1] != key.shape[1],
            )
        elif spec is None:
            padding = _key_padding(attention_mask, query.shape[0], key.shape[2], query.device)
            out = causal_attention(
                query, key, value, scale=scale, window=window, key_padding=padding,
                use_flash_attn=use_flash_attn, dropout=dropout, softcap=softcap,
            )
        else:
            if dropout:
                raise ValueError("tree verification is inference only (dropout must be 0)")
            n = query.shape[2]
            if spec.num_nodes != n:
                raise ValueError(f"tree spec has {spec.num_nodes} nodes but the forward has {n} queries")
            prefix_len = key.shape[2] - n
            if _key_padding(attention_mask, query.shape[0], key.shape[2], query.device) is not None:
                raise ValueError("split tree attention does not support padded batches: use attention=\"sdpa\" or unpadded input")
            _, _, allowed = spec.block(prefix_len, window, query.device)
            out = split_tree_attention(
                query, key[:, :, :prefix_len], value[:, :, :prefix_len], key[:, :, prefix_len:],
                value[:, :, prefix_len:], spec.visibility, spec.depths, scale=scale, window=window,
                max_depth=spec.max_depth, prefix_kernel=prefix_kernel, block_kernel=block_kernel,
                block_allowed=allowed, softcap=softcap,
            )
        return out.transpose(1, 2).contiguous(), None

    return attention


IMPLEMENTATIONS = {
    "split": ("ddtree_split", torch_prefix_kernel(), None, False),
    "fused": ("ddtree_fused", fused_prefix_kernel, fused_block_kernel, False),
    "flash_attn": ("ddtree_fa", flash_attn_prefix_kernel, fused_block_kernel, True),
}


"""backend name -> (transformers attention name, prefix kernel, block kernel, flash-attn for causal calls)."""


def _no_mask(*args, attention_mask=None, **kwargs):
    """Mask builder for the split implementations: they build their own causal/window masks, so only padding passes."""
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        return attention_mask
    return None


def register_attention_implementations() -> None:
    """Register the split implementations with transformers (idempotent), so any HF causal LM can use them by name.

    Their mask builder is registered too: transformers versions differ in what
    they do for an attention name they have no mask builder for.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for impl, prefix_kernel, block_kernel, use_fa in IMPLEMENTATIONS.values():
        AttentionInterface.register(impl, _make_attention_function(prefix_kernel, block_kernel, use_fa))
        AttentionMaskInterface.register(impl, _no_mask)


def prepare_target(model) -> None:
    """What every backend does to a target first: refuse families a tree cannot verify, route GDN layers."""
    from ddtree.targets import families, linear_attention

    families.check_supported(model)
    linear_attention.prepare(model)


def _with_linear_tree(model, tree: DraftTree, kwargs: dict) -> dict:
    """Add the tree for GDN layers when ``model`` has them (attention layers never see it)."""
    from ddtree.targets import linear_attention

    if linear_attention.is_prepared(model):
        kwargs[linear_attention.LINEAR_TREE_KWARG] = tree
    return kwargs


_DENSE_RUNNERS = frozenset({"sdpa", "eager"} | {impl for impl, *_ in IMPLEMENTATIONS.values()})
"""Attention implementations that apply a dense 4D tree mask as given (the split ones run it like sdpa)."""
_SPLIT_RUNNERS = frozenset(impl for impl, *_ in IMPLEMENTATIONS.values())
"""The registered split implementations: each reads the tree spec exactly (they differ only in kernels)."""


def attention_implementation(model) -> str | None:
    """The attention implementation ``model`` runs now (its text config's, for composite models)."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl is None:
        impl = getattr(_text_config(model.config), "_attn_implementation", None)
    return impl


def check_implementation(model, backend_name: str, allowed) -> None:
    """Refuse a verify forward whose target no longer runs an attention implementation that honours the
    backend's kwargs: another generator (or ``set_attn_implementation``) switched it, and the tree would be
    verified under a plain causal mask, silently wrong."""
    impl = attention_implementation(model)
    if impl not in allowed:
        raise RuntimeError(
            f"attention={backend_name!r} verifies trees through the {' / '.join(sorted(allowed))} attention "
            f"implementation, but {type(model).__name__} now runs {impl!r} (another SpeculativeGenerator with a "
            "different attention= on the same target, or set_attn_implementation, changed it): its tree forward "
            "would ignore the tree mask. Give every generator on one target the same attention=, or use "
            "attention=\"sdpa\" for all of them (it runs under every implementation ddtree sets)"
        )


class TreeAttentionBackend(Protocol):
    """How a target's attention sees a tree: ``prepare`` sets the model up once (its attention
    implementation), ``tree_forward_kwargs`` gives one verify forward's extra kwargs (a dense mask, or the
    tree spec a registered implementation reads). ``prefix_valid`` ``[B, prefix_len]`` marks real columns of
    rows padded in the cache."""

    name: str

    def prepare(self, model) -> None: ...

    def tree_forward_kwargs(self, model, tree: DraftTree, prefix_len: int, dtype: torch.dtype,
                            prefix_valid: torch.Tensor | None = None) -> dict: ...


@dataclass
class DenseMaskBackend:
    """Dense additive mask; works with any HF attention implementation that accepts a 4D mask."""

    name: str = "sdpa"

    def prepare(self, model) -> None:
        prepare_target(model)
        impl = getattr(model.config, "_attn_implementation", None)
        if impl not in ("sdpa", "eager"):
            # sdpa where the model has it; eager for models that only run eager (gpt-oss and its sinks)
            model.set_attn_implementation("sdpa" if getattr(model, "_supports_sdpa", True) else "eager")

    def tree_forward_kwargs(self, model, tree: DraftTree, prefix_len: int, dtype: torch.dtype,
                            prefix_valid: torch.Tensor | None = None) -> dict:
        check_implementation(model, self.name, _DENSE_RUNNERS)
        mask = dense_tree_mask(model, tree, prefix_len, dtype, prefix_valid)
        return _with_linear_tree(model, tree, {"attention_mask": mask})


@dataclass
class SplitBackend:
    """Split prefix/tree attention through a registered transformers attention implementation.

    ``dense_below``: for prefixes shorter than this the dense mask is passed
    instead (the registered function runs it like sdpa), since on a CPU the
    split only pays off once the prefix dominates (see docs/attention.md).
    """

    name: str = "split"
    dense_below: int = 0

    @property
    def implementation(self) -> str:
        return IMPLEMENTATIONS[self.name][0]

    def prepare(self, model) -> None:
        if has_attention_sinks(model):
            raise ValueError(
                f"attention={self.name!r} cannot run {type(model).__name__}: its attention sinks (s_aux) need the "
                "model's own eager attention; use attention=\"sdpa\" (the dense tree mask through eager) or \"auto\""
            )
        prepare_target(model)
        register_attention_implementations()
        model.set_attn_implementation(self.implementation)

    def tree_forward_kwargs(self, model, tree: DraftTree, prefix_len: int, dtype: torch.dtype,
                            prefix_valid: torch.Tensor | None = None) -> dict:
        if prefix_len < self.dense_below or prefix_valid is not None:  # the split kernels take no padding
            return DenseMaskBackend(self.name).tree_forward_kwargs(model, tree, prefix_len, dtype, prefix_valid)
        check_implementation(model, self.name, _SPLIT_RUNNERS)
        return _with_linear_tree(model, tree, {TREE_KWARG: TreeAttentionSpec.from_tree(tree)})


@dataclass
class AutoBackend:
    """Picks the best backend for the target's device at ``prepare`` time."""

    chosen: DenseMaskBackend | SplitBackend | None = None

    @property
    def name(self) -> str:
        return self.chosen.name if self.chosen is not None else "auto"

    def prepare(self, model) -> None:
        if has_attention_sinks(model):
            self.chosen = DenseMaskBackend()  # sinks run only in the model's own attention: the dense mask serves it
        else:
            self.chosen = get_backend("auto", device=next(model.parameters()).device)
        self.chosen.prepare(model)

    def tree_forward_kwargs(self, model, tree: DraftTree, prefix_len: int, dtype: torch.dtype,
                            prefix_valid: torch.Tensor | None = None) -> dict:
        if self.chosen is None:
            self.prepare(model)
        return self.chosen.tree_forward_kwargs(model, tree, prefix_len, dtype, prefix_valid)


_ALIASES = {None: "sdpa", "dense": "sdpa", "torch": "split", "torch_cuda": "fused", "flash": "flash_attn"}


BACKENDS = ("auto", "sdpa", "split", "fused", "flash_attn")


CPU_DENSE_BELOW = 1024


"""On a CPU, ``auto`` verifies with the dense mask below this prefix length and splits above it (measured crossover)."""


def auto_backend_name(device: torch.device | str) -> str:
    """``flash_attn`` > ``fused`` on CUDA; ``fused`` on CPU (dense mask below :data:`CPU_DENSE_BELOW`); else ``sdpa``."""
    kind = torch.device(device).type
    if kind == "cuda":
        return "flash_attn" if flash_attn_available() else "fused"
    return "fused" if kind == "cpu" else "sdpa"


def get_backend(name: str | None = "sdpa", device: torch.device | str | None = None):
    """The tree-verify attention backend called ``name``; one of :data:`BACKENDS` (aliases: ``torch_cuda`` = fused).

    ``"auto"`` resolves at once when ``device`` is given, else at ``prepare(model)``.
    """
    name = _ALIASES.get(name, name)
    if name == "auto":
        if device is None:
            return AutoBackend()
        chosen = get_backend(auto_backend_name(device))
        if torch.device(device).type == "cpu" and isinstance(chosen, SplitBackend):
            chosen.dense_below = CPU_DENSE_BELOW
        return chosen
    if name == "sdpa":
        return DenseMaskBackend()
    if name == "flash_attn" and not flash_attn_available():
        raise ValueError("attention='flash_attn' needs the flash-attn package (CUDA); use 'fused' or 'auto' instead")
    if name in IMPLEMENTATIONS:
        return SplitBackend(name)
    raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")


register_attention_implementations()
