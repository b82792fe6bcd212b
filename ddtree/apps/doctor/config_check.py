"""The doctor's config check: every drafter field resolved against the target, read from the raw ``config.json``.

Read from the raw dict (not :class:`~ddtree.drafters.dflash.config.DFlashConfig`)
so that fields a newer config class knows (per-layer causality, an embedding
scale) are reported when present and an older one still works.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ddtree.drafters.dflash.config import DFlashConfig

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass
class Finding:
    """One checked item: ``status`` is ``ok``, ``info``, ``warn`` or ``error``."""

    section: str
    name: str
    value: str
    status: str = "ok"
    note: str = ""


@dataclass
class ConfigReport:
    findings: list[Finding] = field(default_factory=list)
    unknown_keys: list[str] = field(default_factory=list)
    sliding_layers: list[int] = field(default_factory=list)
    embedding_scale: float | None = None
    thinking: str = "none"

    def add(self, section, name, value, status="ok", note="") -> None:
        self.findings.append(Finding(section, name, str(value), status, note))

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.status in ("warn", "error")]


def read_raw_config(drafter_dir) -> dict:
    file = Path(drafter_dir) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"no drafter config at {file}: give the DFlash drafter's directory")
    return json.loads(file.read_text())


def _dflash(raw: dict) -> dict:
    d = raw.get("dflash_config")
    return d if isinstance(d, dict) else {}


def field_value(raw: dict, name: str, default=None):
    """A DFlash field from ``dflash_config`` first, then the top level (publishers use both)."""
    d = _dflash(raw)
    if name in d:
        return d[name]
    return raw.get(name, default)


def _text_config(cfg):
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def rope_theta(cfg) -> float | None:
    """RoPE base from a config object or dict, in any of the spellings transformers 5 and older use."""
    get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
    for key in ("rope_parameters", "rope_scaling"):
        rp = get(key)
        if isinstance(rp, dict) and rp.get("rope_theta") is not None:
            return float(rp["rope_theta"])
    theta = get("rope_theta")
    return None if theta is None else float(theta)


def layer_attention(raw: dict) -> list[tuple[str, int | None, str]]:
    """Per drafter layer: (type, window, causality), resolved by ddtree's DFlash config (as the authors do)."""
    from ddtree.drafters.dflash.config import DFlashConfig

    try:
        resolved = DFlashConfig.from_dict(raw).resolve_attention()
    except (ValueError, TypeError, KeyError) as e:  # the rest of the check reports the fields one by one
        n = int(raw.get("num_hidden_layers") or 0)
        types = raw.get("layer_types") if isinstance(raw.get("layer_types"), list) else [FULL] * n
        return [(t, None, f"unresolved ({e})") for t in types]
    override = raw.get("is_causal", _dflash(raw).get("causal"))
    why = "set by is_causal / dflash_config.causal" if override is not None else "the default for its type"
    return [(a.type, a.window, f"{'causal' if a.causal else 'non-causal'} ({why})") for a in resolved]


def check_config(raw: dict, target_config, tokenizer=None) -> ConfigReport:
    """Resolve every drafter field against the target; flag what an engine could read differently."""
    rep = ConfigReport()
    tc = _text_config(target_config)
    n_target = int(tc.num_hidden_layers)
    ids = field_value(raw, "target_layer_ids")
    n_draft = int(raw.get("num_hidden_layers") or 0)
    # -- target features
    if ids is None:
        rep.add("features", "target_layer_ids", "absent", "warn",
                "not given: ddtree and engines derive a default spread; publish them explicitly")
        ids = []
    for i in ids:
        i = int(i)
        status, note = "ok", f"HF hidden_states[{i + 1}] = output of decoder layer {i} (index 0 is the embedding: +1)"
        if not 0 <= i < n_target:
            status, note = "error", f"outside the target's layers 0..{n_target - 1}"
        elif i == n_target - 1:
            note += ("; the LAST layer: HF's hidden_states[-1] is after the final norm, an engine's auxiliary "
                     "state usually before it")
        rep.add("features", f"target layer {i}", f"hidden_states[{i + 1}]", status, note)
    ntl = raw.get("num_target_layers")
    rep.add("features", "num_target_layers", ntl, "ok" if ntl == n_target else "error",
            f"target has {n_target} decoder layers")
    # -- drafter layers
    attn = layer_attention(raw)
    for j, (t, window, how) in enumerate(attn):
        if t == SLIDING:
            rep.sliding_layers.append(j)
        status = "warn" if t == SLIDING and not window else "ok"
        rep.add("drafter layers", f"drafter layer {j}", t,
                status, f"window {window if window else 'none (full context)'}; {how}")
    if not attn:
        rep.add("drafter layers", "num_hidden_layers", n_draft, "error", "the drafter has no layers")
    # -- sizes
    for name, mine, theirs in (("hidden_size", raw.get("target_hidden_size") or raw.get("hidden_size"), tc.hidden_size),
                               ("vocab_size", raw.get("vocab_size"), tc.vocab_size)):
        rep.add("sizes", name, mine, "ok" if mine == theirs else "error", f"target's {theirs}")
    block = field_value(raw, "block_size")
    rep.add("sizes", "block_size", block, "ok" if isinstance(block, int) and block >= 2 else "error",
            f"an engine runs a chain of block_size - 1 = {block - 1 if isinstance(block, int) else '?'} "
            "draft tokens (num_speculative_tokens)")
    mine, theirs = rope_theta(raw), rope_theta(tc)
    rep.add("sizes", "rope_theta", mine, "ok" if mine is None or theirs is None or mine == theirs else "warn",
            f"target's {theirs}" + ("" if mine == theirs else ": a drafter usually shares its target's RoPE base"))
    # -- embedding scale
    scale = field_value(raw, "input_embedding_scale")
    rep.embedding_scale = None if scale is None else float(scale)
    rep.add("embedding", "input_embedding_scale", "absent (1)" if scale is None else scale,
            "ok" if scale in (None, 1, 1.0) else "info",
            "" if scale in (None, 1, 1.0) else "block embeddings are multiplied by it: an engine must apply it")
    # -- mask token
    mask = field_value(raw, "mask_token_id")
    vocab = int(tc.vocab_size)
    if mask is None:
        rep.add("mask token", "mask_token_id", "absent", "error", "set dflash_config.mask_token_id")
    elif not 0 <= int(mask) < vocab:
        rep.add("mask token", "mask_token_id", mask, "error", f"outside the vocabulary 0..{vocab - 1}")
    else:
        _check_mask(rep, int(mask), tokenizer)
    # -- unknown keys
    rep.unknown_keys = DFlashConfig.unknown_keys(raw)  # the keys ddtree's loader warns about, by the same rule
    for k in rep.unknown_keys:
        rep.add("keys", k, json.dumps(field_value(raw, k.split(".", 1)[-1]))[:40], "warn",
                "unknown key: neither ddtree nor the known engines read it; check its spelling")
    # -- chat template
    rep.thinking = thinking_mode(tokenizer)
    rep.add("chat template", "thinking mode", rep.thinking, "info" if rep.thinking.startswith("on") else "ok",
            "a thinking template changes what the drafter sees; turning thinking off raised acceptance from 25% "
            "to 60% in a public DFlash report" if rep.thinking != "none" else "the template has no thinking switch")
    return rep


def _check_mask(rep: ConfigReport, mask: int, tokenizer) -> None:
    if tokenizer is None:
        rep.add("mask token", "mask_token_id", mask, "info", "no tokenizer to check it against")
        return
    piece = tokenizer.convert_ids_to_tokens(mask)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = mask in set(getattr(tokenizer, "all_special_ids", []) or []) or (
        mask in added and getattr(added[mask], "special", False))
    # Ordinary text: decoding the id and encoding the text back gives the id again as one piece of plain text.
    text = tokenizer.decode([mask])
    ordinary = bool(text.strip()) and tokenizer.encode(text, add_special_tokens=False) == [mask] and not special \
        and mask not in added
    if ordinary:
        rep.add("mask token", "mask_token_id", f"{mask} {piece!r}", "warn",
                "an ordinary text token: the drafter cannot tell a masked slot from real text; use a special token")
    else:
        rep.add("mask token", "mask_token_id", f"{mask} {piece!r}", "ok",
                "a special token" if special else "an added (non-text) token")


def thinking_mode(tokenizer) -> str:
    """``none``, or ``on by default`` / ``off by default`` for a template with an ``enable_thinking`` switch."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if not isinstance(template, str) or ("enable_thinking" not in template and "<think>" not in template):
        return "none"
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                               add_generation_prompt=True)
        forced_off = "<think>\n\n</think>" in prompt
    except Exception:  # a template that needs more context than this: say what is known
        return "present (enable_thinking), default unknown"
    return "off by default" if forced_off else "on by default (enable_thinking)"
