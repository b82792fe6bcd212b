"""Known integration faults, injected into ddtree's own pipeline without touching its internals.

Each fault builds a drafter for the unchanged target: a :class:`FaultyDrafter`
that delegates to the real one and changes what it reads (features) or keeps
(context), a shallow copy with one setting changed, or a drafter loaded from a
modified copy of the drafter directory. A fault that cannot apply to a pair
says why (:class:`Skip`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ddtree.apps.doctor.config_check import FULL, SLIDING, field_value
from ddtree.drafters.base import DraftContext, Drafter


class Skip(Exception):
    """The fault does not apply to this pair (the message says why)."""


@dataclass
class Fault:
    name: str
    title: str  # what the engine does wrong, in plain words
    check: str  # where to look in an engine
    build: Callable  # (Pair) -> (drafter, context manager); raises Skip
    group: str = ""  # the part of an integration it belongs to (faults of one group look alike)
    changes_target: bool = False  # its hooks change what the target computes, not only what the drafter reads


@dataclass
class Pair:
    """What a fault needs: the real drafter, the target, the drafter directory and its raw config."""

    target: object
    drafter: object
    drafter_dir: Path
    raw: dict
    tokenizer: object = None

    @property
    def num_target_layers(self) -> int:
        cfg = self.target.config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        return int(cfg.num_hidden_layers)


class FaultyDrafter(Drafter):
    """Delegates to ``inner``; ``features`` replaces how target features are read, ``context`` how a
    generation's context is made."""

    def __init__(self, inner, features: Callable | None = None, context: Callable | None = None):
        self.inner = inner
        self.block_size = inner.block_size
        # the target layers this read takes (-1: the embedding output), so the round keeps exactly those
        reads = getattr(features, "indices", None)
        self.target_layer_ids = sorted({i - 1 for i in reads}) if reads else list(inner.target_layer_ids)
        self.needs_hidden_states = True
        self._features, self._context = features, context

    def context_features(self, hidden_states):
        return self.inner.context_features(hidden_states) if self._features is None else self._features(hidden_states)

    def new_context(self, batch_size: int = 1):
        return self.inner.new_context(batch_size) if self._context is None else self._context(batch_size)


def _device(drafter):
    model = getattr(drafter, "model", None)
    return model.fc.weight.device if model is not None and hasattr(model, "fc") else None


class ReadLayers:
    """Features from chosen ``hidden_states`` indices (the correct read is ``id + 1`` per layer id);
    indices in ``zero`` give zeros; ``last`` (a one-item list a hook fills) replaces ``hidden_states[-1]``."""

    def __init__(self, indices: Sequence[int], device=None, zero: Sequence[int] = (), last: list | None = None):
        self.indices, self.device, self.zero, self.last = list(indices), device, set(zero), last

    def __call__(self, hidden_states):
        n = len(hidden_states) - 1
        parts = []
        for j, i in enumerate(self.indices):
            h = self.last[0] if self.last is not None and i == n else hidden_states[i]
            parts.append(torch.zeros_like(h) if j in self.zero else h)
        device = self.device if self.device is not None else parts[0].device
        return torch.cat([p.to(device) for p in parts], dim=-1)


class _RowsContext(DraftContext):
    """A context that keeps each row's tokens itself and builds the real one when asked to propose, so a
    fault decides per row what stays (a row's count-0 append leaves it as it was). ``keep(old, new)`` gives a
    row's kept ``(features, tokens)`` after appending ``new`` to ``old`` (``None`` before the first)."""

    def __init__(self, drafter, batch_size: int, keep: Callable):
        self.drafter, self.keep = drafter, keep
        self.kept: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * batch_size  # ([T, F], [T]) per row
        self.inner = None

    def append(self, features, tokens, counts=None, host_counts=None):
        for b in range(tokens.shape[0]):
            n = tokens.shape[1] if counts is None else int(counts[b])
            if n:
                self.kept[b] = self.keep(self.kept[b], (features[b, :n], tokens[b, :n]))
        self.inner = None

    def built(self):
        """The real context holding each row's kept tokens, renumbered from 0."""
        if self.inner is None:
            lengths = [0 if k is None else k[1].numel() for k in self.kept]
            like = next(k for k in self.kept if k is not None)
            features = like[0].new_zeros((len(self.kept), max(lengths), like[0].shape[-1]))
            tokens = like[1].new_zeros((len(self.kept), max(lengths)))
            for b, k in enumerate(self.kept):
                if k is not None:
                    features[b, : lengths[b]], tokens[b, : lengths[b]] = k
            self.inner = self.drafter.new_context(len(self.kept))
            ragged = len(set(lengths)) > 1
            self.inner.append(features, tokens, torch.tensor(lengths, device=tokens.device) if ragged else None)
        return self.inner

    def propose(self, root_tokens):
        return self.built().propose(root_tokens)

    def select_rows(self, rows):
        self.kept = [self.kept[int(i)] for i in rows]
        self.inner = None

    @property
    def tokens(self) -> list[list[int]]:
        return [[] if k is None else k[1].tolist() for k in self.kept]


class DroppedContext(_RowsContext):
    """The cache-drop bug: each append replaces the context, so the drafter sees only the newest tokens.

    RoPE is relative, so renumbering the kept tokens from 0 is what an engine that
    drops its drafter cache computes with the right positions.
    """

    def __init__(self, drafter, batch_size: int):
        super().__init__(drafter, batch_size, lambda old, new: new)


TRUNCATED_KEEP = 16  # context tokens the truncated-context fault keeps


class TruncatedContext(_RowsContext):
    """A drafter cache that keeps only the newest ``keep`` context tokens (an undersized or evicted cache)."""

    def __init__(self, drafter, batch_size: int, keep: int = TRUNCATED_KEEP):
        super().__init__(drafter, batch_size, self._newest)
        self.limit = keep

    def _newest(self, old, new):
        if old is not None:
            new = (torch.cat([old[0], new[0]]), torch.cat([old[1], new[1]]))
        return new[0][-self.limit:], new[1][-self.limit:]


def _nothing() -> contextlib.nullcontext:
    """The hooks of a fault that needs none (the target's forward is then the correct integration's)."""
    return contextlib.nullcontext()


def _decoder_layers(target, last_normed: bool = False):
    """The target's decoder layers as ddtree's forward finds them; ``last_normed``: only where HF's
    ``hidden_states[-1]`` is the final norm's output (else there is no pre-norm state to mix up)."""
    from ddtree.targets.description import describe

    parts = describe(target).decoder_parts
    if parts is None:
        raise Skip("ddtree does not recognise this target's decoder layout (get_decoder().layers)")
    if last_normed and not parts[2]:
        raise Skip("this target's hidden_states[-1] is not after the final norm")
    return parts[1]


def _feature_fault(shift: Callable[[list[int], int], list[int]], zero: Callable[[int], list[int]] | None = None):
    def build(pair: Pair):
        ids = [int(i) for i in pair.drafter.target_layer_ids]
        n = pair.num_target_layers
        idx = shift([i + 1 for i in ids], n)
        if idx == [i + 1 for i in ids] and zero is None:
            raise Skip("it reads the same layers as the correct integration for this drafter")
        read = ReadLayers(idx, _device(pair.drafter), zero(len(ids)) if zero else ())
        return FaultyDrafter(pair.drafter, read), _nothing()
    return build


def _no_offset(idx, n):
    return [i - 1 for i in idx]


def _one_late(idx, n):
    return [min(i + 1, n) for i in idx]


def _repeated(idx, n):
    if len(idx) < 2:
        raise Skip("the drafter reads a single target layer: nothing to repeat")
    return idx[:-2] + [idx[-2], idx[-2]]


def _reordered(idx, n):
    if len(idx) < 2:
        raise Skip("the drafter reads a single target layer: no order to get wrong")
    return idx[::-1]


def _missing(idx, n):
    return list(idx)


def _pre_norm(pair: Pair):
    n = pair.num_target_layers
    ids = [int(i) for i in pair.drafter.target_layer_ids]
    if n - 1 not in ids:
        raise Skip(f"the drafter does not read the last target layer ({n - 1}), where the final norm sits")
    last: list = [None]
    layer = _decoder_layers(pair.target, last_normed=True)[-1]

    def hook(module, args, output):
        last[0] = output[0] if isinstance(output, tuple) else output

    @contextlib.contextmanager
    def hooked():
        handle = layer.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    return FaultyDrafter(pair.drafter, ReadLayers([i + 1 for i in ids], _device(pair.drafter), last=last)), hooked()


def _dropped(pair: Pair):
    return FaultyDrafter(pair.drafter, context=lambda b: DroppedContext(pair.drafter, b)), _nothing()


MASK_ALIKE = 0.98  # a wrong mask token embedding this close (cosine) to the right one cannot show


def _mask_wrong(pair: Pair):
    """The draft slots filled with a wrong id: the likely mix-ups (an id left at its default 0, the pad, eos or
    bos token), of which the one that embeds least like the mask token. A mix-up with a token that embeds
    alike (unused special tokens often share one untrained row) costs nothing and leaves no signature."""
    mask = getattr(pair.drafter, "mask_token_id", None)
    if mask is None:
        raise Skip("the drafter has no mask token")
    tok = pair.tokenizer
    ids = [0] + ([getattr(tok, k, None) for k in ("pad_token_id", "eos_token_id", "bos_token_id")] if tok else [])
    weight = pair.target.get_input_embeddings().weight
    ids = sorted({int(i) for i in ids if i is not None and 0 <= int(i) < weight.shape[0] and int(i) != int(mask)})
    own = getattr(getattr(pair.drafter, "model", None), "mask_embedding", None)  # a checkpoint's own mask row
    right = (own if own is not None else weight[int(mask)]).detach().float()
    cos = {i: float(torch.nn.functional.cosine_similarity(weight[i].detach().float(), right.to(weight.device), 0))
           for i in ids}
    wrong = min(cos, key=cos.get)
    if cos[wrong] > MASK_ALIKE:
        raise Skip(f"every likely wrong id ({', '.join(map(str, ids))}) embeds like the mask token "
                   f"(cosine over {MASK_ALIKE}): such a mix-up changes nothing")
    bad = copy.copy(pair.drafter)
    bad.mask_token_id = wrong
    bad.fault_note = f"token {wrong} in place of {int(mask)}"  # shown with the fault's title
    return bad, _nothing()


@contextlib.contextmanager
def modified_copy(drafter_dir: Path, raw: dict):
    """A temporary drafter directory: this config, the original weights linked in."""
    with tempfile.TemporaryDirectory(prefix="ddtree-doctor-") as tmp:
        for f in Path(drafter_dir).iterdir():
            if f.name != "config.json" and f.suffix == ".safetensors" and "draft_vocab" not in f.name:
                os.symlink(f.resolve(), Path(tmp) / f.name)
        (Path(tmp) / "config.json").write_text(json.dumps(raw))
        yield Path(tmp)


def _from_config(change: Callable[[dict], dict]):
    def build(pair: Pair):
        from ddtree.drafters.dflash.drafter import DFlashDrafter

        raw = change(json.loads(json.dumps(pair.raw)))
        dtype = next(pair.target.parameters()).dtype
        with modified_copy(pair.drafter_dir, raw) as tmp:
            drafter = DFlashDrafter.from_pretrained(tmp, pair.target, dtype=dtype, device=_device(pair.drafter),
                                                    draft_vocab=None)
        return drafter, _nothing()
    return build


def _sliding_types(raw: dict) -> list[str]:
    from ddtree.apps.doctor.config_check import layer_attention

    return [t for t, _, _ in layer_attention(raw)]


def _window_ignored(raw: dict) -> dict:
    types = _sliding_types(raw)
    if SLIDING not in types:
        raise Skip("the drafter has no sliding-window layers")
    raw["layer_types"] = [FULL] * len(types)
    raw.pop("sliding_window", None)
    raw.get("dflash_config", {}).pop("use_swa", None)
    return raw


def _causality_swapped(pair: Pair):
    """Each layer's causality the wrong way round: sliding layers non-causal, full layers causal.

    Sliding layers run causal and full layers non-causal in the authors' code and vLLM; an
    engine (and ddtree, once) that takes one rule for every layer gets one kind wrong.
    """
    model = getattr(pair.drafter, "model", None)
    layers = getattr(model, "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") and hasattr(layer.self_attn, "spec") for layer in layers):
        raise Skip("the drafter's layers do not expose their resolved attention")
    bad = copy.copy(pair.drafter)
    bad.model = copy.deepcopy(model)
    for layer in bad.model.layers:
        spec = layer.self_attn.spec
        layer.self_attn.spec = spec._replace(causal=spec.type != SLIDING)
    if all(a.self_attn.spec == b.self_attn.spec for a, b in zip(bad.model.layers, model.layers)):
        raise Skip("every layer already has the swapped causality (the config overrides it)")
    return bad, _nothing()


def _truncated(pair: Pair):
    return FaultyDrafter(pair.drafter, context=lambda b: TruncatedContext(pair.drafter, b)), _nothing()


def _scale_ignored(raw: dict) -> dict:
    from ddtree.drafters.dflash.config import DFlashConfig

    scale = field_value(raw, "input_embedding_scale")
    if scale is None or float(scale) == 1.0:
        raise Skip("the drafter has no input embedding scale (1)")
    if "input_embedding_scale" not in DFlashConfig.__dataclass_fields__:
        raise Skip("this ddtree's DFlash config does not apply input_embedding_scale")
    raw.pop("input_embedding_scale", None)
    raw.get("dflash_config", {}).pop("input_embedding_scale", None)
    return raw


QUANT_BITS, QUANT_GROUP = 4, 128  # the low-precision fault's weight quantisation


def quantised(weight: torch.Tensor, bits: int = QUANT_BITS, group: int = QUANT_GROUP) -> torch.Tensor:
    """``weight`` rounded to ``bits``-bit integers and back: symmetric, round to nearest, one scale per ``group``
    consecutive inputs of each row (the last group of a row shorter when ``group`` does not divide it)."""
    rows = weight.detach().float().reshape(-1, weight.shape[-1])
    width = rows.shape[1]
    padded = torch.nn.functional.pad(rows, (0, -width % group)).view(rows.shape[0], -1, group)
    top = 2 ** (bits - 1) - 1
    scale = padded.abs().amax(-1, keepdim=True).clamp(min=1e-12) / top
    out = (torch.round(padded / scale).clamp(-top, top) * scale).view(rows.shape[0], -1)[:, :width]
    return out.reshape(weight.shape).to(weight.dtype)


def _low_precision(pair: Pair):
    """The target's decoder weight matrices quantised (:func:`quantised`) while the fault runs, then put back.

    A drafter is trained on a 16-bit target's features. On the default pair bf16 and fp8
    (e4m3, one scale per tensor) cost it nothing measurable (docs/doctor.md); a 4-bit target,
    as GPTQ/AWQ-class quantisation serves it, does.
    """
    params = [p for layer in _decoder_layers(pair.target) for m in layer.modules()
              if not isinstance(m, torch.nn.modules.conv._ConvNd)
              for p in m.parameters(recurse=False) if p.ndim >= 2 and p.is_floating_point()]
    if not params:
        raise Skip("the target's decoder layers hold no weight matrices to round")

    @contextlib.contextmanager
    def rounded():
        saved = [p.data for p in params]
        try:
            for p in params:
                p.data = quantised(p.data)
            yield
        finally:
            for p, d in zip(params, saved):
                p.data = d

    return pair.drafter, rounded()


FAULTS = [
    Fault("no_offset", "layer ids read without the +1 offset (hidden_states[i] for layer i)",
          "the aux-hidden-state layer indices: HF hidden_states[0] is the embedding",
          _feature_fault(_no_offset), "features"),
    Fault("one_late", "every feature layer read one layer late",
          "the layer whose output is captured for each id", _feature_fault(_one_late), "features"),
    Fault("layer_missing", "the last feature layer missing (zeros)",
          "that every target_layer_id is captured", _feature_fault(_missing, zero=lambda n: [n - 1]), "features"),
    Fault("layer_repeated", "a feature layer repeated in place of the last one",
          "the order and uniqueness of the captured layers", _feature_fault(_repeated), "features"),
    Fault("layers_reordered", "the feature layers concatenated in reverse order",
          "the order in which the captured layers are concatenated (it must be target_layer_ids' order)",
          _feature_fault(_reordered), "features"),
    Fault("pre_norm_last", "the last target layer read before the final norm (HF's hidden_states[-1] is normed)",
          "whether the aux state of the last layer is taken before or after the model's final norm",
          _pre_norm, "features"),
    Fault("window_ignored", "the sliding window ignored (sliding layers see the whole context)",
          "the drafter's layer_types / sliding_window handling", _from_config(_window_ignored), "attention"),
    Fault("causality_swapped", "sliding layers made non-causal and full layers causal",
          "the per-layer is_causal / layer types handling", _causality_swapped, "attention"),
    Fault("context_dropped", "the drafter context dropped every round (only the newest tokens kept)",
          "the drafter's KV cache across rounds (the cache-drop bug)", _dropped, "context"),
    Fault("context_truncated", f"the drafter context truncated to its newest {TRUNCATED_KEEP} tokens every round",
          "the drafter's KV cache size and eviction (it must hold the whole context, or the window)",
          _truncated, "context"),
    Fault("mask_wrong", "the wrong mask token embedded in the draft slots",
          "which token id fills the block's masked slots (dflash_config.mask_token_id)", _mask_wrong, "block input"),
    Fault("scale_ignored", "the input embedding scale ignored",
          "dflash_config.input_embedding_scale", _from_config(_scale_ignored), "block input"),
    Fault("low_precision", f"the target's weights in {QUANT_BITS} bits (round to nearest, groups of {QUANT_GROUP})",
          "the target's serving dtype and quantisation (the drafter was trained on a 16-bit target)",
          _low_precision, "precision", changes_target=True),
]
FAULTS_BY_NAME = {f.name: f for f in FAULTS}
