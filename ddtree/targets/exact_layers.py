"""A decode step's norms, MLPs and attention blocks as a few row-kernel calls, under ``numerics="exact"``.

Run as transformers writes them, a Llama-family layer is some thirty small torch ops per token (the norm alone
is eight), and on a CPU a decoding step spends as long in those as in its matrix products. Under exact
numerics the products are already ddtree's packed row kernels; this module gives the rest the same treatment,
module by module: an RMSNorm becomes :func:`~ddtree.targets.row_kernels.rms_norm`, a SwiGLU MLP three packed
products around :func:`~ddtree.targets.row_kernels.silu_mul`, and the attention block of the Llama, Mistral,
Mixtral, Qwen2, Qwen3 and Qwen3-MoE families its packed products, :func:`~ddtree.targets.row_kernels.rotary`
and the exact attention function. Each op computes a row alone, so a tree node and a one-token step still get
the same bits. Where a decoder layer's parts are all taken (Llama, Mistral, Qwen2, Qwen3), its whole decode
forward is one C call that runs the same kernels in the same order (``ddtree_decoder_layer``): bit for bit the
module-by-module path, without the Python between the steps.

A module is taken only when it is recognised: a norm or an MLP by running it beside its replacement on a
probe (it must agree to the dtype's rounding), an attention block by its class and parts. Everything else, and
every forward inside :func:`~ddtree.targets.cpu_linear.bulk_rows` (a long prompt's prefill), runs transformers'
own code. A short unpadded prompt's prefill is a chain of tokens the stack runs as it runs a tree.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ddtree.targets import cpu_linear, kv_room, row_kernels
from ddtree.targets.exact_attention import EXACT_IMPLEMENTATION, ExactTreeSpec, exact_attention, one_token_keys
from ddtree.targets.registration import TREE_KWARG, idle, reads_output_only

ATTENTION_CLASSES = {"LlamaAttention": None, "MistralAttention": "config", "MixtralAttention": "config",
                     "Qwen2Attention": "module", "Qwen3Attention": "module", "Qwen3MoeAttention": "module"}
"""Attention blocks whose forward is projections, an optional per-head q/k norm, rotary embedding, the cache
update and the attention function, then the output projection (transformers 5.0 to 5.25), and where each
reads its sliding window: none, ``config.sliding_window`` or the module's ``sliding_window``."""

_FUSED = "_ddtree_exact_layer"


def _decoding(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this call is an exact decode forward the row ops take (not a prefill, not autograd)."""
    return not (cpu_linear.in_bulk() or x.dtype != weight.dtype or x.device.type != "cpu"
                or torch.compiler.is_compiling() or (torch.is_grad_enabled() and (x.requires_grad
                                                                                  or weight.requires_grad)))


def _probe(width: int, dtype: torch.dtype) -> torch.Tensor:
    """Three rows off zero mean (so a LayerNorm, which subtracts it, cannot pass for an RMSNorm)."""
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(3, width, generator=generator) * 2 + 1).to(dtype)


def _one_input(module: torch.nn.Module) -> bool:
    """Whether the module's forward takes one tensor (a gated norm, taking two, is another function)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    required = [p for p in params if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) == 1 and all(p.kind != p.VAR_POSITIONAL for p in params)


def _agrees(ours: torch.Tensor, theirs: Any, dtype: torch.dtype, *, elementwise: bool) -> bool:
    """Whether a replacement's probe output is the module's up to the dtype's rounding: each element to a few
    of its own roundings (``elementwise``, for the norms), or to the output's scale (a product's sums)."""
    if not isinstance(theirs, torch.Tensor) or theirs.shape != ours.shape or theirs.dtype != ours.dtype:
        return False
    eps = torch.finfo(dtype).eps
    diff, size = (ours.float() - theirs.float()).abs(), theirs.float().abs()
    if elementwise:
        return bool((diff <= 8 * eps * (size + 1e-3 * size.amax())).all())
    return bool((diff <= max(16 * eps, 1e-4) * (size + size.amax().clamp(min=1.0))).all())


def _norm_eps(module: torch.nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


_STYLE = "_ddtree_norm_style"


def _norm_style(module: torch.nn.Module) -> str | None:
    """How an RMSNorm scales by its weight (:data:`~ddtree.targets.row_kernels.NORM_STYLES`), found by running
    it beside each style on a probe (the style matching the most elements bit for bit among those that agree),
    or None when it is not an RMSNorm the kernel computes (a LayerNorm, a gated norm, another module)."""
    weight, eps = getattr(module, "weight", None), _norm_eps(module)
    if (not isinstance(weight, torch.Tensor) or weight.dim() != 1 or eps is None or "norm" not in
            type(module).__name__.lower() or weight.dtype not in row_kernels.ROW_OP_DTYPES
            or weight.device.type != "cpu" or not weight.is_contiguous()
            or any(True for _ in module.children()) or len(list(module.parameters())) != 1
            or not _one_input(module)):
        return None
    with torch.no_grad():
        probe = _probe(weight.shape[0], weight.dtype)
        try:
            theirs = module.forward(probe)
        except Exception:  # a forward that does not take one [rows, width] tensor is not this function
            return None
        best, matches = None, -1
        for style in row_kernels.NORM_STYLES:
            ours = row_kernels.rms_norm(probe, weight.detach(), eps, style)
            if _agrees(ours, theirs, weight.dtype, elementwise=True):
                same = int((ours == theirs).sum())
                if same > matches:
                    best, matches = style, same
        return best


def _routed_linears(module: torch.nn.Module, names: tuple[str, ...]) -> list[torch.nn.Linear] | None:
    """The module's linears of these names, each routed exactly and of one dtype the row ops take, or None."""
    layers = [getattr(module, name, None) for name in names]
    found = [layer for layer in layers if isinstance(layer, torch.nn.Linear) and cpu_linear.routed_exactly(layer)]
    if len(found) != len(names) or found[0].weight.dtype not in row_kernels.ROW_OP_DTYPES:
        return None
    return found if all(layer.weight.dtype == found[0].weight.dtype for layer in found) else None


def _is_swiglu(module: torch.nn.Module) -> bool:
    """A ``down(act(gate(x)) * up(x))`` MLP of exactly routed linears with a SiLU ``act_fn``, agreeing on a
    probe."""
    parts = _routed_linears(module, ("gate_proj", "up_proj", "down_proj"))
    act = getattr(module, "act_fn", None)
    if (parts is None or type(act).__name__ not in ("SiLUActivation", "SiLU")
            or {n for n, _ in module.named_children()} != {"gate_proj", "up_proj", "down_proj", "act_fn"}
            or not _one_input(module)):
        return False
    weight = parts[0].weight
    with torch.no_grad():
        probe = _probe(weight.shape[1], weight.dtype)
        return _agrees(_swiglu(module, probe), module.forward(probe), weight.dtype, elementwise=False)


def _is_attention(module: torch.nn.Module) -> bool:
    if type(module).__name__ not in ATTENTION_CLASSES:
        return False
    if _routed_linears(module, ("q_proj", "k_proj", "v_proj", "o_proj")) is None:
        return False
    norms = [getattr(module, name, None) for name in ("q_norm", "k_norm")]
    if any(n is not None for n in norms) and not all(n is not None and _FUSED in vars(n) for n in norms):
        return False  # Qwen3's per-head norms must themselves be taken
    head_dim = getattr(module, "head_dim", None)
    return isinstance(head_dim, int) and isinstance(getattr(module, "layer_idx", None), int)


def _product(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return cpu_linear.exact_product(layer, x)


def _swiglu(module: Any, x: torch.Tensor) -> torch.Tensor:
    gate, up = _product(module.gate_proj, x), _product(module.up_proj, x)
    return _product(module.down_proj, row_kernels.silu_mul(gate, up))


def _cache_kwargs_positional() -> bool:
    """transformers 5.0's ``Cache.update`` takes a ``cache_kwargs`` dict; later ones take ``**kwargs``."""
    from transformers.cache_utils import Cache

    return "cache_kwargs" in inspect.signature(Cache.update).parameters


def _window(attn: Any) -> int | None:
    """The sliding window a taken attention block passes to its attention function (:data:`ATTENTION_CLASSES`)."""
    source = ATTENTION_CLASSES[type(attn).__name__]
    return None if source is None else getattr(attn.config if source == "config" else attn, "sliding_window", None)


_ATTENTION_ARGS = ("hidden_states", "position_embeddings", "attention_mask")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


def _parts(module: torch.nn.Module, names: tuple[str, ...]) -> list[torch.nn.Module]:
    """The named children a taken module calls itself (a hook on one of them must see that call)."""
    held = module._modules
    return [held[n] for n in names if held.get(n) is not None]  # type: ignore[misc]


def _row_tables(embeddings: Any, bsz: int, n: int, d: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rotary tables ``(cos, sin)`` as the row kernels read them, one contiguous ``[bsz, n, d]`` row per input
    row (a table shared by the rows, as transformers makes it for positions without a batch, copied out to
    each), or None where they are not tables for these rows."""
    if not isinstance(embeddings, (tuple, list)) or len(embeddings) != 2:
        return None
    cos, sin = embeddings
    if (not isinstance(cos, torch.Tensor) or not isinstance(sin, torch.Tensor) or cos.shape != sin.shape
            or cos.dim() != 3 or cos.shape[0] not in (1, bsz) or cos.shape[1:] != (n, d)):
        return None
    if cos.shape[0] != bsz:
        return cos.expand(bsz, n, d).contiguous(), sin.expand(bsz, n, d).contiguous()
    return cos.contiguous(), sin.contiguous()


def _attention(module: Any, original: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    call = dict(zip(_ATTENTION_ARGS, args), **kwargs)
    hidden_states, position_embeddings = call.get("hidden_states"), call.get("position_embeddings")
    if (len(args) > len(_ATTENTION_ARGS) or not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3
            or position_embeddings is None or not _decoding(hidden_states, module.q_proj.weight)
            or _watched(*_parts(module, _ATTENTION_PARTS))):  # a hook on a projection or norm sees its calls
        return original(*args, **kwargs)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name in ("hidden_states", "position_embeddings"):
        del call[name]
    attention_mask = call.pop("attention_mask", None)
    store = call.pop("cache", None)
    store = call.pop("past_key_values", None) if store is None else store
    cache_position = call.pop("cache_position", None)
    bsz, n = hidden_states.shape[:2]
    d = module.head_dim
    tables = _row_tables(position_embeddings, bsz, n, d)
    if tables is None:
        return original(*args, **kwargs)
    q = _product(module.q_proj, hidden_states).view(bsz, n, -1, d)
    k = _product(module.k_proj, hidden_states).view(bsz, n, -1, d)
    v = _product(module.v_proj, hidden_states).view(bsz, n, -1, d)
    if getattr(module, "q_norm", None) is not None:
        q = _norm(module.q_norm, None, q)
        k = _norm(module.k_norm, None, k)
    cos, sin = tables
    row_kernels.rotary(q, cos, sin)
    row_kernels.rotary(k, cos, sin)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if store is not None:
        if _POSITIONAL[0]:
            k, v = store.update(k, v, module.layer_idx, {"sin": sin, "cos": cos, "cache_position": cache_position})
        else:
            k, v = store.update(k, v, module.layer_idx, kwargs=call)
    functions, implementation = ALL_ATTENTION_FUNCTIONS, module.config._attn_implementation
    attend = (functions.get_interface(implementation, exact_attention) if hasattr(functions, "get_interface")
              else functions[implementation])  # as the model itself looks it up (5.0 has no get_interface)
    if ATTENTION_CLASSES[type(module).__name__] is not None:  # as the family passes it
        call["sliding_window"] = _window(module)
    out, _ = attend(module, q, k, v, attention_mask, dropout=0.0, scaling=module.scaling, **call)
    return _product(module.o_proj, out.reshape(bsz, n, -1)), None


_POSITIONAL: list[bool] = [False]


def _install(module: torch.nn.Module, forward: Any) -> None:
    original = module.forward

    @functools.wraps(original)
    def patched(*args: Any, **kwargs: Any) -> Any:
        return forward(module, original, *args, **kwargs)

    module.forward = patched  # patches this instance
    vars(module)[_FUSED] = patched


def _norm(module: Any, original: Any, x: torch.Tensor) -> torch.Tensor:
    if original is not None and not _decoding(x, module.weight):
        return original(x)
    style, eps = vars(module)[_STYLE]
    return row_kernels.rms_norm(x, module.weight, eps, style)


def _mlp(module: Any, original: Any, x: torch.Tensor) -> torch.Tensor:
    if not _decoding(x, module.gate_proj.weight) or _watched(module.gate_proj, module.up_proj, module.down_proj):
        return original(x)
    return _swiglu(module, x)


DECODER_CLASSES = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"})
"""Pre-norm decoder layers (norm, attention, residual; norm, MLP, residual) whose whole decode forward runs as
one C call once their norms, attention block and SwiGLU MLP are taken (transformers 5.0 to 5.25)."""

_DECODER_ARGS = ("hidden_states", "attention_mask", "position_ids")
_SLOTS = ("x", "y", "ln1", "ln2", "qn", "kn", "pq", "pk", "pv", "po", "pg", "pu", "pd", "bq", "bk", "bv", "bo",
          "bg", "bu", "bd", "cos", "sin", "kc", "vc", "start", "vis", "ends", "h", "hq", "hkv", "d", "i", "cap",
          "b", "n", "style1", "style2", "styleq", "stylek", "dt", "threads")
"""The C layer's integer arguments, in ``csrc/row_invariant.c``'s ``L_*`` order."""


def _is_decoder(module: torch.nn.Module) -> bool:
    if type(module).__name__ not in DECODER_CLASSES:
        return False
    parts = [getattr(module, name, None)
             for name in ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")]
    return (all(isinstance(p, torch.nn.Module) and _FUSED in vars(p) for p in parts)
            and type(module.mlp).__name__.endswith("MLP") and not getattr(module.self_attn, "sinks", None)
            and len(list(module.children())) == 4)


def _watched(*modules: torch.nn.Module) -> bool:
    """Whether something would see these modules' calls, which the C layer does not make: a forward hook (but
    transformers' output capture while it collects nothing), or a forward replaced by anything but this
    module's or the exact routing's (a profiler's timer, say)."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    for m in modules:
        forward = vars(m).get("forward")
        if m._forward_pre_hooks or (forward is not None and vars(m).get(_FUSED) is not forward
                                    and not cpu_linear.runs_exact_forward(m)):
            return True
        if m._forward_hooks and not all(idle(h) for h in m._forward_hooks.values()):
            return True
    return False


def _pointer(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


_SLOT = {name: i for i, name in enumerate(_SLOTS)}
_CALL_SLOTS = tuple(_SLOT[name] for name in ("x", "y", "cos", "sin", "kc", "vc", "start", "vis", "ends", "cap",
                                             "b", "n", "threads"))
"""The slots each call fills, in :func:`_decoder`'s order."""
_PLAN = "_ddtree_layer_plan"
_KC, _VC, _CAP, _START, _VIS = (_SLOT[name] for name in ("kc", "vc", "cap", "start", "vis"))
_SHARED = ("x", "y", "ystep", "cos", "sin", "ends", "b", "n", "threads")
"""What ``ddtree_decoder_stack`` gives every layer of a forward, in ``csrc/row_invariant.c``'s ``S_*`` order."""


def _stamp(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), row_kernels.version(t)


class _LayerPlan:
    """What a decoder layer's C call takes that changes only with its weights, made once: the argument arrays
    with those slots filled, the modules a hook could watch, and the weights it was made from (a weight that is
    replaced, moved or changed in place makes a new plan, repacking what changed)."""

    __slots__ = ("ints", "floats", "weights", "stamps", "watch", "window", "layer_idx", "hkv", "d", "parts",
                 "params", "forwards", "attn")

    def __init__(self, module: Any):
        attn, mlp = module.self_attn, module.mlp
        self.attn = attn
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        norms = [module.input_layernorm, module.post_attention_layernorm, getattr(attn, "q_norm", None),
                 getattr(attn, "k_norm", None)]
        # what current() compares, as dict lookups (a module's __getattr__ costs more than the C layer's checks)
        self.parts = [(parent._modules, name, parent._modules[name]) for parent, names in (
            (module, ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")),
            (attn, tuple(n for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
                         if n in attn._modules)),
            (mlp, ("gate_proj", "up_proj", "down_proj"))) for name in names]
        self.params = [(m._parameters, name, m._parameters[name]) for m in (*linears, *(n for n in norms if n))
                       for name in ("weight", "bias") if m._parameters.get(name) is not None]
        self.forwards: list[tuple[torch.nn.Module, dict, Any]] | None = None  # as when last seen unwatched
        packed = [cpu_linear.packed_weight(p) for p in linears]
        self.d = attn.head_dim
        self.hkv = attn.k_proj.weight.shape[0] // self.d
        self.layer_idx = attn.layer_idx
        self.window = _window(attn)
        self.watch = (attn, mlp, module.input_layernorm, module.post_attention_layernorm, *attn.children(),
                      mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        self.weights = [p.weight for p in linears] + [p.bias for p in linears if p.bias is not None] + [
            m.weight for m in norms if m is not None]
        self.stamps = [(w, *_stamp(w)) for w in self.weights]  # an inference tensor's version: -1, unread
        styles = [(0, 0.0) if m is None else (row_kernels.NORM_STYLES[vars(m)[_STYLE][0]], vars(m)[_STYLE][1])
                  for m in norms]
        self.ints = (ctypes.c_int64 * len(_SLOTS))()
        static = dict(
            ln1=norms[0].weight.data_ptr(), ln2=norms[1].weight.data_ptr(),
            qn=_pointer(None if norms[2] is None else norms[2].weight),
            kn=_pointer(None if norms[3] is None else norms[3].weight),
            **{f"p{c}": w.data.data_ptr() for c, w in zip("qkvogud", packed)},
            **{f"b{c}": _pointer(p.bias) for c, p in zip("qkvogud", linears)},
            h=attn.q_proj.weight.shape[1], hq=attn.q_proj.weight.shape[0] // self.d, hkv=self.hkv, d=self.d,
            i=mlp.gate_proj.weight.shape[0], style1=styles[0][0], style2=styles[1][0], styleq=styles[2][0],
            stylek=styles[3][0], dt=row_kernels.DTYPE_CODES[attn.q_proj.weight.dtype])
        for name, value in static.items():
            self.ints[_SLOT[name]] = value
        self.floats = (ctypes.c_double * 5)(styles[0][1], styles[1][1], styles[2][1], styles[3][1], attn.scaling)

    def current(self) -> bool:
        """Whether the layer's parts and weights are still the modules, tensors, storage and versions this plan
        was made from."""
        for held, name, part in self.parts:
            if held.get(name) is not part:
                return False
        for held, name, tensor in self.params:
            if held.get(name) is not tensor:
                return False
        for w, pointer, version in self.stamps:
            if w.data_ptr() != pointer or (version >= 0 and w._version != version):
                return False
        return True

    def unwatched(self) -> bool:
        """``not _watched(*self.watch)``, at the cost of comparing each module's forward with what it was when
        the full check last passed (and looking for hooks)."""
        from torch.nn.modules import module as nn_module

        if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
            return False
        if self.forwards is not None and all(
                held.get("forward") is forward and not (m._forward_hooks or m._forward_pre_hooks)
                for m, held, forward in self.forwards):
            return True
        if _watched(*self.watch):
            return False
        self.forwards = [(m, vars(m), vars(m).get("forward")) for m in self.watch]
        return True


_STACK = "_ddtree_decoder_stack"
_UNCHANGED: contextvars.ContextVar[object | None] = contextvars.ContextVar("ddtree_unchanged", default=None)


@contextlib.contextmanager
def unchanged_between_forwards() -> Iterator[None]:
    """A scope whose caller vouches that nothing but the target's forwards touches the model inside it (a
    ``generate`` call that hands no tokens to the caller's code until it returns): a decoder stack checked in full
    at the scope's first forward (every layer's plan, weights, watched modules and their forwards) is not checked
    again in it: that check reads some 2,000 objects the C layers' weights have pushed out of the caches, a
    share of a small model's step worth saving. The layers' own hooks, the global hooks and the input are still
    checked each forward (a forward's capture of hidden states hooks the layers)."""
    token = _UNCHANGED.set(object())
    try:
        yield
    finally:
        _UNCHANGED.reset(token)


class _DecoderStack:
    """A model's taken decoder layers, checked together at the first C layer of each forward (plans current, no
    hooks) so that its later layers skip their own checks: after a C layer has streamed its weights through the
    caches, each Python check reads memory again (about a sixth of a one-row step, spread over its layers). A
    forward is known by its rotary table, a new tensor each forward that every layer of it receives, and its
    cache."""

    __slots__ = ("modules", "index", "forward", "ends", "chain", "vouched")

    def __init__(self, modules: list[Any]):
        self.modules = modules  # the decoder layer modules, in the order the model runs them
        self.index = {id(m): i for i, m in enumerate(modules)}
        self.chain: _Chain | None = None  # this forward's C calls, made at its first C layer
        # (scope, dtype, grad): the unchanged_between_forwards scope whose full check passed, and for what input
        self.vouched: tuple[object, torch.dtype, bool] | None = None
        # (table, id(cache), passed): the table is held, so its id is not reused meanwhile
        self.forward: tuple[torch.Tensor, int, bool] | None = None
        self.ends: tuple[tuple[int, int], torch.Tensor] | None = None

    def passed(self, table: torch.Tensor, store: Any, x: torch.Tensor) -> bool:
        """Whether every layer passed the check, made at this forward's first layer with its input ``x``."""
        seen = self.forward
        if seen is None or seen[0] is not table or seen[1] != id(store):
            seen = self.forward = (table, id(store), self._check(x))
        return seen[2]

    def _check(self, x: torch.Tensor, readers: bool = True) -> bool:
        """Every layer a decode forward for ``x`` takes as a C call (:func:`_decoding`, the exact attention), its
        plan current (made again where stale), and no hooks but readers of its output (``OUTPUT_READER``,
        transformers' capture of hidden states): any other hook on a decoder layer could change the next layer
        mid-forward, so it declines (each layer then checks itself). Without ``readers`` (a forward that calls
        no layer module) any hook but an idle one (transformers' capture, collecting nothing now), or a forward
        other than the taken one, declines."""
        from torch.nn.modules import module as nn_module

        if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks or not _decoding(x, x):
            return False  # the input's half of _decoding, once; each layer's weight below
        grad, config = torch.is_grad_enabled(), None
        for m in self.modules:  # the layers' own hooks come and go with each forward's capture of hidden states
            own = vars(m).get(_FUSED)
            if (own is None or m._forward_pre_hooks
                    or not all(idle(h) or readers and reads_output_only(h) for h in m._forward_hooks.values())
                    or not readers and vars(m).get("forward") is not own):
                return False
        scope = _UNCHANGED.get()
        if scope is not None and self.vouched == (scope, x.dtype, grad):
            return True  # checked in full at this scope's first forward, and nothing else has run since
        self.vouched = None
        for m in self.modules:
            plan = _plan(m)  # current: its weights are the layer's own tensors
            weight = plan.weights[0]  # q_proj's
            if weight.dtype != x.dtype or (grad and weight.requires_grad):
                return False
            held = getattr(plan.attn, "config", None)
            if held is not config:  # the layers share one config, as a rule: its property read once
                if held is None or held._attn_implementation != EXACT_IMPLEMENTATION:
                    return False
                config = held
            if not plan.unwatched():
                return False
        self.vouched = None if scope is None else (scope, x.dtype, grad)
        return True

    def run(self, x: torch.Tensor, embeddings: tuple[torch.Tensor, torch.Tensor], spec: ExactTreeSpec | None,
            mask: torch.Tensor | None, store: Any) -> torch.Tensor | None:
        """Every layer's output for a forward of ``x`` (rotary ``embeddings``, a tree ``spec`` or a one-token
        step's padding ``mask``) through ``store``, as a decoder loop over the modules would give them, stacked
        ``[layers, *x.shape]``, all layers in one C call (``ddtree_decoder_stack``); or None, with no layer run,
        where the stack does not take the forward (:meth:`_check` with no hooks but idle ones, cache layers the C call
        cannot append to or holding different lengths)."""
        layers = getattr(store, "layers", None)
        if not isinstance(layers, list) or not (spec is not None or x.shape[1] == 1) or not self._check(x, False):
            return None
        bsz, n = x.shape[0], x.shape[1]
        plans = [vars(m)[_PLAN] for m in self.modules]
        tables = _row_tables(embeddings, bsz, n, plans[0].d)
        found = [_appendable(plan, layers, bsz, x.dtype) for plan in plans]
        held = None if found[0] is None else found[0][1]
        if (tables is None or held is None or any(f is None or f[1] != held for f in found)
                or any(p.d != plans[0].d for p in plans)):
            return None
        ranges: dict[int | None, tuple[torch.Tensor, torch.Tensor] | None] = {}
        for plan in plans:  # each window's key ranges, once
            if plan.window not in ranges:
                ranges[plan.window] = _key_ranges(plan, spec, mask, bsz, n, held, x.device)
        if any(r is None for r in ranges.values()):
            return None
        rooms = [(layer, kv_room.room_for(layer, n)) for layer, _ in found]  # type: ignore[misc]  # none is None
        outputs = _stack_call(plans, x, tables, [room for _, room in rooms], ranges,
                              self.ends_for(bsz, held))
        for layer, (keys, values) in rooms:
            layer.keys, layer.values = keys.narrow(2, 0, held + n), values.narrow(2, 0, held + n)
        return outputs

    def run_packed(self, x: torch.Tensor, embeddings: tuple[torch.Tensor, torch.Tensor],
                   rooms: list[tuple[torch.Tensor, torch.Tensor]], lengths: torch.Tensor,
                   key_ranges: Callable[[int | None], tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """:meth:`run` through fixed row-packed rooms: attention layer ``i``'s keys and values ``rooms[i]``
        ``[B, Hkv, capacity, D]`` hold row ``b``'s committed columns at ``0 .. lengths[b] - 1``, and the forward
        writes its ``n`` new columns after them; ``key_ranges(window)`` gives each node's ``(start, visible)``
        (int64 ``[B, n]``, uint8 ``[B, n, n]``) for a layer with that window. None, with no layer run, where
        the stack does not take the forward or the rooms are not the layers' own."""
        if not self._check(x, False):
            return None
        bsz, n = x.shape[0], x.shape[1]
        plans = [vars(m)[_PLAN] for m in self.modules]
        tables = _row_tables(embeddings, bsz, n, plans[0].d)
        if tables is None or len(rooms) != len(plans) or any(
                p.d != plans[0].d or p.layer_idx >= len(rooms) or not _packed_room(rooms[p.layer_idx], p, bsz, x.dtype)
                for p in plans):
            return None
        ranges = {window: key_ranges(window) for window in {p.window for p in plans}}
        if any(start.shape != (bsz, n) or visible.shape != (bsz, n, n) or start.dtype != torch.int64
               or visible.dtype != torch.uint8 for start, visible in ranges.values()):
            return None
        ends = lengths.to(torch.int64).contiguous()
        return _stack_call(plans, x, tables, [rooms[p.layer_idx] for p in plans], ranges, ends)

    def start_empty(self, store: Any, bsz: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Start ``store``'s cache layers of these layers at zero columns (transformers' own first update, with
        nothing in it), so that a prefill's first forward appends to them as :meth:`run` does; whether every
        layer now is one it appends to (False, with nothing started, where one cannot be)."""
        from transformers.cache_utils import DynamicLayer

        layers = getattr(store, "layers", None)
        plans = [vars(m).get(_PLAN) or _plan(m) for m in self.modules]  # shapes only: run() checks them
        grown = getattr(store, "layer_class_to_replicate", None) is DynamicLayer  # a missing layer is made so
        if not isinstance(layers, list) or any(
                type(layers[p.layer_idx]) is not DynamicLayer if p.layer_idx < len(layers) else not grown
                for p in plans):
            return False
        for plan in sorted(plans, key=lambda p: p.layer_idx):
            if plan.layer_idx >= len(layers) or not getattr(layers[plan.layer_idx], "is_initialized", False):
                empty = torch.empty(bsz, plan.hkv, 0, plan.d, dtype=dtype, device=device)
                store.update(empty, empty, plan.layer_idx)
        return all(_appendable(p, layers, bsz, dtype) is not None for p in plans)

    def ends_for(self, bsz: int, held: int) -> torch.Tensor:
        """Every row's prefix end, ``held`` (the same tensor for each layer of a forward)."""
        if self.ends is None or self.ends[0] != (bsz, held):
            self.ends = ((bsz, held), torch.full((bsz,), held, dtype=torch.int64))
        return self.ends[1]


def _stack_call(plans: list[_LayerPlan], x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor],
                rooms: list[tuple[torch.Tensor, torch.Tensor]], ranges: dict, ends: torch.Tensor) -> torch.Tensor:
    """Every layer's output ``[layers, *x.shape]`` from one ``ddtree_decoder_stack`` call: layer ``i`` appends
    to ``rooms[i]`` after each row's prefix end ``ends[b]`` and attends with its window's key ranges."""
    bsz, n = x.shape[0], x.shape[1]
    x = x.contiguous()
    outputs = x.new_empty((len(plans), *x.shape))
    held = []  # what the slots point into, alive until the call returns
    for plan, room in zip(plans, rooms):
        start, visible = ranges[plan.window]
        ints = plan.ints
        ints[_KC], ints[_VC], ints[_CAP] = room[0].data_ptr(), room[1].data_ptr(), room[0].shape[-2]
        ints[_START], ints[_VIS] = start.data_ptr(), visible.data_ptr()
        held.append((start, visible))
    shared = (ctypes.c_int64 * len(_SHARED))(
        x.data_ptr(), outputs.data_ptr(), outputs[0].numel() * outputs.element_size(), tables[0].data_ptr(),
        tables[1].data_ptr(), ends.data_ptr(), bsz, n, row_kernels.caller_threads())
    count = len(plans)
    ints_of = (ctypes.c_void_p * count)(*(ctypes.addressof(p.ints) for p in plans))
    floats_of = (ctypes.c_void_p * count)(*(ctypes.addressof(p.floats) for p in plans))
    row_kernels.decoder_stack(ints_of, floats_of, count, shared)
    return outputs


def _packed_room(room: tuple[torch.Tensor, torch.Tensor], plan: _LayerPlan, bsz: int, dtype: torch.dtype) -> bool:
    """Whether ``room`` is a row-packed layer's keys and values the C call can append to for ``plan``."""
    return all(t.dim() == 4 and t.shape[0] == bsz and t.shape[1] == plan.hkv and t.shape[3] == plan.d
               and t.shape == room[0].shape and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
               for t in room)


def _plan(module: Any) -> _LayerPlan:
    plan = vars(module).get(_PLAN)
    if plan is None or not plan.current():
        plan = _LayerPlan(module)
        vars(module)[_PLAN] = plan
    return plan


_KEYS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_MASK_KEYS = "_ddtree_step_keys"


def _step_keys(mask: torch.Tensor | None, bsz: int, kv_len: int, window: int | None,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~ddtree.targets.exact_attention.one_token_keys`, made once per forward for every layer: kept on
    the padding mask itself (for its length, window and version, or, for an inference tensor, which has no
    version, its content: it goes with the tensor) or, without a mask, by the shape alone (constants then)."""
    if mask is None:
        key: tuple = (bsz, kv_len if window is not None else 0, window)
        found = _KEYS.get(key)
        if found is None:
            if len(_KEYS) > 64:
                _KEYS.clear()
            found = _KEYS[key] = one_token_keys(None, bsz, kv_len, window, device)
        return found
    version = row_kernels.version(mask)
    key = (bsz, kv_len, window, version)
    held = getattr(mask, _MASK_KEYS, None)
    # an inference tensor keeps no version: its content is compared with the copy the keys were made from
    if held is None or held[0] != key or (version < 0 and not torch.equal(held[1], mask)):
        held = (key, mask.clone() if version < 0 else None, one_token_keys(mask, bsz, kv_len, window, device))
        setattr(mask, _MASK_KEYS, held)
    return held[2]


def _appendable(plan: _LayerPlan, layers: list, bsz: int, dtype: torch.dtype) -> tuple[Any, int] | None:
    """``plan``'s cache layer and the columns it holds, where it is one the C call appends to in place (an
    initialized transformers ``DynamicLayer`` of these rows, heads, width and dtype), else None."""
    from transformers.cache_utils import DynamicLayer

    if plan.layer_idx >= len(layers):
        return None
    layer = layers[plan.layer_idx]
    keys = getattr(layer, "keys", None)
    if (type(layer) is not DynamicLayer or not getattr(layer, "is_initialized", False) or keys is None
            or keys.dim() != 4 or keys.shape[0] != bsz or keys.shape[1] != plan.hkv or keys.shape[-1] != plan.d
            or keys.dtype != dtype):
        return None
    return layer, keys.shape[-2]


def _key_ranges(plan: _LayerPlan, spec: ExactTreeSpec | None, mask: torch.Tensor | None, bsz: int, n: int,
                held: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The C call's ``(start, visible)`` for ``n`` new columns after ``held``: the tree spec's, or a one-token
    step's from its padding mask; None where they are not one row per input row."""
    if spec is None:  # a one-token step without a tree spec, as exact attention takes it
        start, visible = _step_keys(mask, bsz, held + n, plan.window, device)
    else:
        start, visible = spec.keys(held, plan.window)
    return (start, visible) if start.shape == (bsz, n) else None


def _prepare(plan: _LayerPlan, layers: list, x: torch.Tensor, y: torch.Tensor, embeddings: tuple,
             spec: ExactTreeSpec | None, mask: torch.Tensor | None, stack: _DecoderStack | None
             ) -> tuple[Any, tuple[torch.Tensor, torch.Tensor], int, tuple] | None:
    """Fill ``plan``'s call slots for ``x`` -> ``y`` through its cache layer (its room made where needed), or
    None where this layer's cache is not one the C call appends to in place. Returns the layer, its room, the
    columns it held and the tensors the slots point into (kept alive until the call)."""
    bsz, n, _ = x.shape
    found = _appendable(plan, layers, bsz, x.dtype)
    if found is None:
        return None
    layer, held = found
    ranges = _key_ranges(plan, spec, mask, bsz, n, held, x.device)
    cos, sin = embeddings
    if ranges is None or cos.shape != (bsz, n, plan.d) or not (cos.is_contiguous() and sin.is_contiguous()):
        return None  # the C layer reads one table row per input row
    start, visible = ranges
    room = kv_room.room_for(layer, n)
    ends = torch.full((bsz,), held, dtype=torch.int64) if stack is None else stack.ends_for(bsz, held)
    ints = plan.ints
    for slot, value in zip(_CALL_SLOTS, (
            x.data_ptr(), y.data_ptr(), cos.data_ptr(), sin.data_ptr(), room[0].data_ptr(), room[1].data_ptr(),
            start.data_ptr(), visible.data_ptr(), ends.data_ptr(), room[0].shape[-2], bsz, n,
            row_kernels.caller_threads())):
        ints[slot] = value
    return layer, room, held, (start, visible, ends, cos, sin)


class _Chain:
    """One forward's C calls for a run of consecutive layers, made together at the first of them: the later
    layers' Python then runs between no C calls (warm caches) and hands back their outputs. Each layer takes
    its output only for the input the chain gave it (the previous layer's output, as a plain decoder loop
    passes it) and a padding mask that gives the same key ranges; any other input, mask or table, and it
    computes again (the C call rewrites the same room columns), as does every layer after it."""

    __slots__ = ("key", "mask", "entries")

    def __init__(self, key: tuple, mask: torch.Tensor | None, entries: dict[int, tuple]):
        self.key = key  # (cos, sin, spec, id(cache)): the tensors held, so no id is reused meanwhile
        self.mask = mask
        self.entries = entries  # id(module) -> (input, output, layer, room, held, what its slots point into)

    def entry(self, module: Any, x: torch.Tensor, embeddings: tuple, spec: Any, mask: Any, store: Any
              ) -> tuple | None:
        key = self.key
        if not (key[0] is embeddings[0] and key[1] is embeddings[1] and key[2] is spec and key[3] == id(store)):
            return None
        entry = self.entries.get(id(module))
        if entry is None or entry[0] is not x:
            return None
        # a layer type may get its own copy of the padding mask (transformers makes one per type)
        same = mask is self.mask or (isinstance(mask, torch.Tensor) and isinstance(self.mask, torch.Tensor)
                                     and mask.shape == self.mask.shape and torch.equal(mask == 0, self.mask == 0))
        return entry if same else None


def _run_chain(stack: _DecoderStack, module: Any, x: torch.Tensor, embeddings: tuple, spec: Any, mask: Any,
               store: Any, layers: list) -> _Chain | None:
    """Prepare ``module`` and the layers after it while each can (every one then runs its C call), or None."""
    entries: dict[int, tuple] = {}
    calls = []
    inp = x
    tables = _row_tables(embeddings, x.shape[0], x.shape[1], vars(module)[_PLAN].d)
    if tables is None:
        return None
    for m in stack.modules[stack.index[id(module)]:]:
        plan = vars(m)[_PLAN]
        out = torch.empty_like(inp)
        prepared = _prepare(plan, layers, inp, out, tables, spec, mask, stack)
        if prepared is None:
            break
        entries[id(m)] = (inp, out, *prepared)
        calls.append(plan)
        inp = out
    if not calls:
        return None
    for plan in calls:
        row_kernels.decoder_layer(plan.ints, plan.floats)
    return _Chain((embeddings[0], embeddings[1], spec, id(store)), mask, entries)


def _decoder(module: Any, original: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The layer's decode forward as one C call (the module-by-module path's kernels, in its order: the same
    bits), where the call is a decode forward through an in-place attention cache; otherwise its own forward.
    Where the whole stack passed its check, the first layer runs the C calls of every layer after it too."""
    call = dict(zip(_DECODER_ARGS, args), **kwargs)
    x, embeddings, spec = call.get("hidden_states"), call.get("position_embeddings"), call.get(TREE_KWARG)
    store = call.get("cache", call.get("past_key_values"))
    layers = getattr(store, "layers", None)
    mask = call.get("attention_mask") if spec is None else None
    if (len(args) > len(_DECODER_ARGS) or not isinstance(x, torch.Tensor) or x.dim() != 3 or embeddings is None
            or not (isinstance(spec, ExactTreeSpec) or spec is None and x.shape[1] == 1)
            or not isinstance(layers, list)
            or not (mask is None or isinstance(mask, torch.Tensor) and mask.dim() == 2)):
        return original(*args, **kwargs)
    stack = vars(module).get(_STACK)
    # the chain knows a forward by its tables: a copy made here each layer would be another forward to it
    if (stack is not None and all(t.is_contiguous() for t in embeddings)
            and stack.passed(embeddings[0], store, x)):
        chain = stack.chain
        entry = None if chain is None else chain.entry(module, x, embeddings, spec, mask, store)
        if entry is None:
            chain = stack.chain = _run_chain(stack, module, x.contiguous(), embeddings, spec, mask, store, layers)
            entry = None if chain is None else chain.entries.get(id(module))
            if entry is None:
                return original(*args, **kwargs)
        del chain.entries[id(module)]
        if not chain.entries:  # the chain's last layer: hold none of the forward's tensors past it
            stack.chain = None
        _, y, layer, room, held, _ = entry
        n = y.shape[1]
        layer.keys, layer.values = room[0][..., :held + n, :], room[1][..., :held + n, :]
        return y
    if (not _decoding(x, module.self_attn.q_proj.weight)
            or module.self_attn.config._attn_implementation != EXACT_IMPLEMENTATION):
        return original(*args, **kwargs)
    plan = _plan(module)
    if not plan.unwatched():
        return original(*args, **kwargs)
    x = x.contiguous()
    y = torch.empty_like(x)
    tables = _row_tables(embeddings, x.shape[0], x.shape[1], plan.d)
    if tables is None:
        return original(*args, **kwargs)
    prepared = _prepare(plan, layers, x, y, tables, spec, mask, None)
    if prepared is None:
        return original(*args, **kwargs)
    layer, room, held, _kept = prepared
    row_kernels.decoder_layer(plan.ints, plan.floats)
    layer.keys, layer.values = room[0][..., :held + x.shape[1], :], room[1][..., :held + x.shape[1], :]
    return y


def install(model: torch.nn.Module) -> int:
    """Take ``model``'s recognised norms, MLPs and attention blocks (its linears already routed exactly, by
    :func:`ddtree.targets.cpu_linear.install`); returns how many. Idempotent."""
    _POSITIONAL[0] = _cache_kwargs_positional()
    count = 0
    modules = [m for m in model.modules() if _FUSED not in vars(m)]
    for module in modules:
        style = _norm_style(module)
        if style is not None:
            vars(module)[_STYLE] = (style, _norm_eps(module))
            _install(module, _norm)
            count += 1
        elif _is_swiglu(module):
            _install(module, _mlp)
            count += 1
    for module in modules:  # after the norms: Qwen3's attention needs its q/k norms taken
        if _is_attention(module):
            _install(module, _attention)
            count += 1
    decoders = [module for module in modules if _is_decoder(module)]  # after their parts
    stack = _DecoderStack(decoders)
    for module in decoders:
        _install(module, _decoder)
        vars(module)[_STACK] = stack
    return count + len(decoders)


def uninstall(model: torch.nn.Module) -> int:
    """Give every taken module its own forward back; returns how many."""
    count = 0
    for module in model.modules():
        if vars(module).pop(_FUSED, None):
            vars(module).pop(_STYLE, None)
            vars(module).pop(_PLAN, None)
            vars(module).pop(_STACK, None)
            del module.forward
            count += 1
    return count


def decoder_stack(model: torch.nn.Module) -> _DecoderStack | None:
    """The stack of ``model``'s taken decoder layers (the one :func:`install` made), or None."""
    for module in model.modules():
        stack = vars(module).get(_STACK)
        if stack is not None:
            return stack
    return None


def installed(model: torch.nn.Module) -> int:
    """How many of ``model``'s modules run as row-kernel calls."""
    return sum(1 for m in model.modules() if _FUSED in vars(m))
