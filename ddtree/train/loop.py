"""The DFlash drafter training loop.

Read top to bottom:

* :func:`make_batch` draws random anchor positions in each sequence's response.
  A block is ``[token at anchor, mask, ..., mask]`` at positions
  ``anchor .. anchor + B - 1``; slot ``k`` must predict the token at
  ``anchor + k``. The block attends to the cached target features of every
  position before its anchor and, bidirectionally, to its own slots only
  (plus the sliding window on sliding layers). All blocks of a sequence share
  one context, so one forward serves ``anchors_per_seq`` blocks.
* :func:`block_loss` scores the predicted slots with a weight ``exp(-(k-1)/gamma)``
  that decays with depth, mixing hard cross-entropy on the actual next token with
  soft cross-entropy on the teacher's cached top-k distribution. The softmax runs
  over a vocabulary subset (frequent tokens + this batch's labels + random
  negatives): the lm_head is the most expensive matmul of the step.
* :func:`evaluate` measures, on held-out sequences and with the FULL vocabulary,
  the per-depth accuracy of greedy drafts and the expected chain acceptance
  length ``E[1 + leading correct slots]`` (what a greedy DFlash chain achieves
  when the target's continuation is the held-out text).
* :func:`train` is the loop: AdamW on fp32 master weights, bf16 autocast,
  warmup + cosine learning rate, periodic eval, checkpoint/resume, and export of
  the best drafter in the published format.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from ddtree.drafters.dflash.config import DFlashConfig
from ddtree.drafters.dflash.model import DFlashDraftModel
from ddtree.train.config import TrainConfig
from ddtree.train.data import FeatureDataset
from ddtree.train.parallel import DataParallel

NEG_INF = torch.finfo(torch.float32).min


# --------------------------------------------------------------------------- batches


def draw_blocks(ds: FeatureDataset, seq_ks: list[int], anchors_per_seq: int, block_size: int,
                gen: torch.Generator, full_blocks: bool = False) -> list[tuple[int, int, torch.Tensor]]:
    """Random anchors in each sequence's response: ``(start, length, sorted anchors)`` per usable sequence.

    Drawn the same on every data-parallel rank (same generator), which then packs its own share.
    """
    rows = []
    for k in seq_ks:
        start, n, p = ds.sequence(k)
        lo = max(p, 1)
        hi = n - block_size if full_blocks else n - 2  # inclusive: slot 1 must exist (or all slots when full_blocks)
        if hi < lo:
            continue
        count = hi - lo + 1
        take = min(anchors_per_seq, count)
        anchors = (torch.randperm(count, generator=gen)[:take] + lo).sort().values
        rows.append((start, n, anchors))
    return rows


def make_batch(ds: FeatureDataset, seq_ks: list[int], anchors_per_seq: int, block_size: int, mask_token_id: int,
               gen: torch.Generator, full_blocks: bool = False) -> dict | None:
    """Random anchor blocks from the given sequences, with their shared contexts and block-sparse mask."""
    rows = draw_blocks(ds, seq_ks, anchors_per_seq, block_size, gen, full_blocks)
    return pack_blocks(ds, rows, anchors_per_seq, block_size, mask_token_id) if rows else None


def block_targets(
    ds: FeatureDataset, rows: list, anchors_per_seq: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels [S, A, B-1], teacher ids [S, A, B-1, K])`` of the drawn blocks (-100: no label), features untouched."""
    data, B = ds.data, block_size
    labels = torch.full((len(rows), anchors_per_seq, B - 1), -100, dtype=torch.long)
    t_ids = torch.zeros(len(rows), anchors_per_seq, B - 1, data["topk_ids"].shape[1], dtype=torch.long)
    for s, (start, n, anchors) in enumerate(rows):
        tgt = anchors[:, None] + torch.arange(1, B)
        lab = data["input_ids"][start + tgt.clamp(max=n - 1)].long()
        labels[s, :len(anchors)] = torch.where(tgt < n, lab, torch.full_like(lab, -100))
        t_ids[s, :len(anchors)] = data["topk_ids"][start + (tgt - 1).clamp(max=n - 1)].long()
    return labels, t_ids


def pack_blocks(ds: FeatureDataset, rows: list, anchors_per_seq: int, block_size: int, mask_token_id: int) -> dict:
    """The batch of the drawn blocks: features of the shared contexts, block tokens, mask, labels, teacher."""
    data, B = ds.data, block_size
    ids_all = data["input_ids"]
    S, A = len(rows), anchors_per_seq
    C = max(int(a.max()) for _, _, a in rows)  # context needed: positions < the last anchor
    Fdim = ds.features.shape[1]
    feats = torch.zeros(S, C, Fdim, dtype=ds.features.dtype)
    block_tokens = torch.full((S, A, B), mask_token_id, dtype=torch.long)
    block_pos = torch.zeros(S, A, B, dtype=torch.long)
    labels, t_ids = block_targets(ds, rows, anchors_per_seq, block_size)
    t_lp = torch.full(t_ids.shape, NEG_INF, dtype=torch.float32)
    anchor_of = torch.full((S, A), -1, dtype=torch.long)  # -1: padding anchor
    ar = torch.arange(B)
    for s, (start, n, anchors) in enumerate(rows):
        m = min(C, n)
        feats[s, :m] = ds.features[start:start + m]
        na = len(anchors)
        anchor_of[s, :na] = anchors
        block_tokens[s, :na, 0] = ids_all[start + anchors].long()
        pos = anchors[:, None] + ar  # [na, B]
        block_pos[s, :na] = pos
        tgt = pos[:, 1:]  # positions predicted by slots 1..B-1
        ok = tgt < n
        src = start + (tgt - 1).clamp(max=n - 1)  # teacher distribution for token t lives at t-1
        lp = data["topk_logprobs"][src].float()
        t_lp[s, :na] = torch.where(ok[..., None], lp, torch.full_like(lp, NEG_INF))
    # mask over keys [context (C) ; blocks (A*B)]
    ctx_pos = torch.arange(C)
    ctx_ok = ctx_pos[None, None, :] < anchor_of[:, :, None]  # [S, A, C]; padding anchors (-1) see none
    same_blk = torch.eye(A, dtype=torch.bool)[:, :, None, None].expand(A, A, B, B)  # [A, A', B, B']
    blk_ok = same_blk.permute(0, 2, 1, 3).reshape(A * B, A * B)
    allowed = torch.cat([ctx_ok[:, :, None, :].expand(S, A, B, C).reshape(S, A * B, C),
                         blk_ok[None].expand(S, -1, -1)], dim=-1)
    return {
        "features": feats, "ctx_pos": ctx_pos[None].expand(S, C), "block_tokens": block_tokens.view(S, A * B),
        "block_pos": block_pos.view(S, A * B), "allowed": allowed, "labels": labels, "teacher_ids": t_ids,
        "teacher_logprobs": t_lp,
    }


def to_device(batch: dict, device: str | torch.device) -> dict:
    """The batch's tensors on ``device`` (batches are drawn and packed on the CPU)."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def key_mask(batch: dict) -> torch.Tensor:
    """Which keys each packed block slot may see at all (its own block, the context before it): ``[S, 1, Q, K]``.
    The model adds each layer's own rule (causal sliding layers, windows) by position on top."""
    return batch["allowed"][:, None]


def draft_hidden(model: DFlashDraftModel, embed: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Drafter output ``[S, A, B-1, H]`` for the predicted slots of every block."""
    S = batch["features"].shape[0]
    ctx = model.project_context(batch["features"])
    h = model(model.embed_block(batch["block_tokens"], embed), batch["block_pos"], context=ctx,
              context_positions=batch["ctx_pos"], key_mask=key_mask(batch))
    B = model.config.block_size
    return h.view(S, -1, B, h.shape[-1])[:, :, 1:]


# --------------------------------------------------------------------------- loss


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    k = torch.arange(block_size - 1, dtype=torch.float32)
    return torch.exp(-k / gamma) if gamma > 0 else torch.ones(block_size - 1)


def loss_vocab(static_vocab: torch.Tensor | None, labels: torch.Tensor, teacher_ids: torch.Tensor, vocab_size: int,
               negatives: int, gen: torch.Generator) -> torch.Tensor | None:
    """The ids the step's softmax runs over: the static frequent ones, the batch's labels and teacher tokens, and
    random negatives that keep the tail suppressed (None: the full vocabulary). Data-parallel ranks pass the
    whole global batch's labels, so every rank scores the same subset as one process would."""
    if static_vocab is None:
        return None
    valid = labels >= 0
    extra = torch.randint(0, vocab_size, (negatives,), generator=gen)
    return torch.unique(torch.cat([static_vocab, labels[valid], teacher_ids[valid].flatten(), extra]))


def weight_total(labels: torch.Tensor, gamma: float) -> torch.Tensor:
    """Sum of the slot weights over the labelled slots: the loss's denominator (of the global batch)."""
    w = slot_weights(labels.shape[-1] + 1, gamma).expand_as(labels)
    return w[labels >= 0].sum()


def block_loss(hidden: torch.Tensor, batch: dict, lm_weight: torch.Tensor, cfg: TrainConfig,
               vocab_ids: torch.Tensor | None, total_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Depth-weighted mix of hard and soft cross-entropy over a vocabulary subset (``vocab_ids``; None: all).

    The loss and the weighted slot accuracy are sums over this batch's slots divided by ``total_weight``
    (default: this batch's own), so data-parallel ranks that divide by the global batch's sum add up to it.
    """
    labels, t_ids, t_lp = batch["labels"], batch["teacher_ids"], batch["teacher_logprobs"]
    B1 = labels.shape[-1]
    w = slot_weights(B1 + 1, cfg.loss_gamma).to(hidden.device).expand_as(labels)
    valid = labels >= 0
    h, lab, w = hidden[valid], labels[valid], w[valid]
    tid, tlp = t_ids[valid], t_lp[valid]
    V = lm_weight.shape[0]
    if vocab_ids is not None:
        sub = vocab_ids.to(lm_weight.device)
        remap = torch.full((V,), -1, dtype=torch.long, device=lm_weight.device)
        remap[sub] = torch.arange(len(sub), device=lm_weight.device)
        W, lab_s, tid_s = lm_weight[sub], remap[lab], remap[tid]
    else:
        W, lab_s, tid_s = lm_weight, lab, tid
    logits = (h @ W.t().to(h.dtype)).float()
    logp = torch.log_softmax(logits, dim=-1)
    hard = -logp.gather(1, lab_s[:, None]).squeeze(1)
    tprob = torch.softmax(tlp, dim=-1)  # teacher top-k, renormalised
    soft = -(tprob * logp.gather(1, tid_s)).sum(-1)
    per = (1 - cfg.soft_weight) * hard + cfg.soft_weight * soft
    den = w.sum() if total_weight is None else total_weight.to(w.device)
    loss = (per * w).sum() / den
    with torch.no_grad():
        acc1 = (logits.argmax(-1) == lab_s).float()
        acc = (acc1 * w).sum() / den
    return loss, {"acc": acc}


# --------------------------------------------------------------------------- eval


@torch.no_grad()
def evaluate(model: DFlashDraftModel, embed, lm_head, ds: FeatureDataset, num_blocks: int, anchors_per_seq: int,
             seed: int = 1234, autocast: bool = True, device: str | torch.device = "cpu") -> dict:
    """Held-out per-depth greedy accuracy and expected chain acceptance (full vocabulary); batches are drawn on
    the CPU and run on ``device``."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    B = model.config.block_size
    correct_lead, per_depth, n_blocks = [], torch.zeros(B - 1), 0
    order = torch.randperm(len(ds), generator=gen).tolist()
    i = 0
    while n_blocks < num_blocks and i < len(order):
        ks = order[i:i + 4]
        i += 4
        batch = make_batch(ds, ks, anchors_per_seq, B, model.config.mask_token_id, gen, full_blocks=True)
        if batch is None:
            continue
        batch = to_device(batch, device)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
            h = draft_hidden(model, embed, batch)
        labels = batch["labels"]
        keep = (labels >= 0).all(-1)  # full blocks only
        h, labels = h[keep], labels[keep]
        pred = torch.cat([lm_head(x.to(lm_head.weight.dtype)).argmax(-1) for x in h.split(256)])
        ok = (pred == labels).float().cpu()
        per_depth += ok.sum(0)
        correct_lead.append(ok.cumprod(-1).sum(-1))
        n_blocks += len(labels)
    model.train()
    if n_blocks == 0:
        return {"acceptance": 1.0, "per_depth": [0.0] * (B - 1), "blocks": 0, "cond": [0.0] * (B - 1)}
    lead = torch.cat(correct_lead)
    reach = torch.stack([(lead >= d).float().mean() for d in range(1, B)])  # P(first d slots all correct)
    cond = [float(reach[0])] + [float(reach[d] / reach[d - 1]) if reach[d - 1] > 0 else 0.0 for d in range(1, B - 1)]
    return {
        "acceptance": float(1 + lead.mean()),
        "per_depth": [round(float(x), 4) for x in per_depth / n_blocks],
        "reach": [round(float(x), 4) for x in reach],
        "cond": [round(x, 4) for x in cond],
        "blocks": n_blocks,
    }


# --------------------------------------------------------------------------- model


def build_drafter(cfg: TrainConfig, target, mask_token_id: int, target_layer_ids: list[int],
                  cache: dict | None = None, log=print) -> DFlashDraftModel:
    dcfg = DFlashConfig.for_target(
        target.config, num_hidden_layers=cfg.num_layers, block_size=cfg.block_size, mask_token_id=mask_token_id,
        target_layer_ids=target_layer_ids, intermediate_size=cfg.intermediate_size or None)
    model = DFlashDraftModel(dcfg)
    if cfg.init_from_drafter:
        for line in init_from_drafter(model, cfg.init_from_drafter, cache):
            log(f"[init] {line}")
    elif cfg.init_from_target >= 0:
        init_from_target_layer(model, target, cfg.init_from_target)
    return model.float()


def init_from_drafter(model: DFlashDraftModel, path: str, cache: dict | None = None) -> list[str]:
    """Warm start from a trained drafter, so more data or a longer run need not repeat the early steps.

    The drafter may read other target layers than the run, as long as it reads as many: each
    replaced layer's ``fc`` columns are rescaled by the ratio of the two layers' feature RMS in
    ``cache`` (the feature cache, which must hold both), so the projection starts at the scale it
    was trained for. This is how a drafter is moved off a layer that engines read differently
    (the last one). Returns what was changed, one line per replaced layer.
    """
    src = DFlashDraftModel.from_pretrained(path, dtype=torch.float32)
    keys = ("hidden_size", "num_hidden_layers", "block_size", "mask_token_id", "intermediate_size", "layer_types")
    def norm(v):
        return list(v) if isinstance(v, (list, tuple)) else v

    diff = {k: (norm(getattr(src.config, k)), norm(getattr(model.config, k))) for k in keys}
    old_ids, new_ids = list(src.config.target_layer_ids), list(model.config.target_layer_ids)
    if len(old_ids) != len(new_ids):
        diff["target_layer_ids"] = (old_ids, new_ids)
    diff = {k: v for k, v in diff.items() if v[0] != v[1]}
    if diff:
        detail = ", ".join(f"{k}: drafter has {a}, run asks for {b}" for k, (a, b) in diff.items())
        raise ValueError(f"--init-from-drafter {path} does not fit this run ({detail}); "
                         "pass the same drafter options as the run that trained it")
    state = src.state_dict()
    changed = [(slot, a, b) for slot, (a, b) in enumerate(zip(old_ids, new_ids)) if a != b]
    notes = []
    if changed:
        cached = list(cache["layer_ids"]) if cache is not None else []
        missing = sorted({x for _, a, b in changed for x in (a, b) if x not in cached})
        if missing:
            raise ValueError(f"--init-from-drafter {path} reads target layers {old_ids}, the run {new_ids}: the "
                             f"feature cache must hold both to rescale the replaced ones, and lacks {missing}; "
                             "add them to --cache-layer-ids and rebuild the cache")
        h = cache["features"].shape[1] // len(cached)
        w = state["fc.weight"].clone()
        for slot, a, b in changed:
            ratio = layer_rms(cache, a, h) / layer_rms(cache, b, h)
            w[:, slot * h:(slot + 1) * h] *= ratio
            notes.append(f"feature slot {slot}: target layer {a} -> {b}, fc columns scaled by {ratio:.4f} "
                         f"(feature RMS {layer_rms(cache, a, h):.3f} -> {layer_rms(cache, b, h):.3f})")
        state["fc.weight"] = w
    model.load_state_dict(state)
    return notes


def layer_rms(cache: dict, layer: int, width: int, rows: int = 20000) -> float:
    """RMS of one cached target layer's features over (at most) the first ``rows`` positions."""
    col = list(cache["layer_ids"]).index(layer) * width
    x = cache["features"][:rows, col:col + width].float()
    return float(x.pow(2).mean().sqrt())


def init_from_target_layer(model: DFlashDraftModel, target, layer: int) -> None:
    """Copy a target decoder layer's attention/MLP/norm weights into every drafter layer (shapes permitting)."""
    base = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    src = base.layers[layer].state_dict()
    for dl in model.layers:
        own = dl.state_dict()
        upd = {k: v.float() for k, v in src.items() if k in own and own[k].shape == v.shape}
        dl.load_state_dict(upd, strict=False)


def lr_at(step: int, cfg: TrainConfig, minutes: float = 0.0) -> float:
    """Linear warmup, then cosine to ``min_lr`` over the steps or the time budget, whichever ends first."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    if cfg.max_minutes:
        frac = max(frac, min(1.0, minutes / cfg.max_minutes))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * frac))


def frequent_vocab(ranked: torch.Tensor, n: int) -> torch.Tensor | None:
    """The loss's static vocabulary: the ``n`` top-ranked ids, sorted (None: the full vocabulary)."""
    if n <= 0 or n >= ranked.numel():
        return None
    return ranked[:n].sort().values


# --------------------------------------------------------------------------- loop


class DraftForward(torch.nn.Module):
    """The drafter's training forward as one module call (what DDP wraps); the frozen target embedding is held
    outside the module tree, so DDP neither broadcasts nor reduces it."""

    def __init__(self, model: DFlashDraftModel, embed: torch.nn.Module):
        super().__init__()
        self.model = model
        self._embed = (embed,)

    def forward(self, batch: dict) -> torch.Tensor:
        return draft_hidden(self.model, self._embed[0], batch)


def train(cfg: TrainConfig, target, train_ds: FeatureDataset, heldout_ds: FeatureDataset, mask_token_id: int,
          log=print, reload=None, device: str | torch.device = "cpu", dp: DataParallel | None = None) -> dict:
    """Train (or resume) a drafter; returns the best eval. Writes ckpt.pt, log.jsonl, best/ under out_dir.

    ``reload()``, when given, returns fresh ``(train_ds, heldout_ds)`` or None; it is
    called at each eval so that shards still being generated join the run (one rank only).
    ``device`` is where the drafter trains (the target's embedding and head must be there too); ``dp``
    the data-parallel ranks (see :mod:`ddtree.train.parallel`): every rank calls this with the same data.
    """
    dp = dp or DataParallel()
    device = torch.device(device)
    out = Path(cfg.out_dir)
    if dp.main:
        out.mkdir(parents=True, exist_ok=True)
    else:
        log = _quiet
    torch.manual_seed(cfg.seed)
    for p in target.parameters():
        p.requires_grad_(False)
    embed = target.get_input_embeddings()
    lm_head = target.get_output_embeddings()
    lm_weight = lm_head.weight.detach().float()
    use_autocast = cfg.use_autocast(str(device))

    model = build_drafter(cfg, target, mask_token_id, train_ds.layer_ids, cache=train_ds.data, log=log).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    step, best, elapsed_before = 0, {"acceptance": 0.0}, 0.0
    ckpt_path = out / "ckpt.pt"
    if cfg.resume and ckpt_path.exists():
        ck = torch.load(ckpt_path, map_location=device, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, best, elapsed_before = ck["step"], ck.get("best", best), ck.get("elapsed", 0.0)
        log(f"[train] resumed from {ckpt_path} at step {step} (best acceptance {best['acceptance']:.3f})")
    forward = dp.wrap(DraftForward(model, embed), device)
    if reload is not None and dp.active:
        log("[train] --reload-data is off under torchrun: every rank must train on the same sequences")
        reload = None
    V = lm_weight.shape[0]
    ranked = train_ds.ranked_vocab(V)  # token frequencies: the loss vocabulary and the draft vocab
    static_vocab = frequent_vocab(ranked, cfg.vocab_subset)
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + step)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[train] drafter {cfg.num_layers} layer(s), {n_params / 1e6:.2f}M params, block {cfg.block_size}, "
        f"target layers {train_ds.layer_ids}, mask token {mask_token_id}; train {len(train_ds)} seqs "
        f"({train_ds.response_tokens()} response tokens), held-out {len(heldout_ds)} seqs; device {device}"
        f"{f' x {dp.world} ranks' if dp.active else ''}, bf16 autocast {'on' if use_autocast else 'off'}")

    def save(tag_best: bool = False):
        if not dp.main:
            return
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "best": best,
                    "elapsed": elapsed_before + time.time() - t0, "config": vars(cfg)}, str(ckpt_path) + ".tmp")
        Path(str(ckpt_path) + ".tmp").replace(ckpt_path)
        if tag_best:
            model.draft_vocab = ranked[:cfg.draft_vocab] if cfg.draft_vocab else None
            model.save_pretrained(out / "best", dtype=torch.bfloat16)
            (out / "best" / "train_stats.json").write_text(json.dumps({"step": step, **best}, indent=2))

    def do_eval():
        nonlocal best
        ev = None
        if dp.main:
            ev = evaluate(model, embed, lm_head, heldout_ds, cfg.eval_blocks, cfg.anchors_per_seq,
                          autocast=use_autocast, device=device)
        ev = dp.share(ev)
        is_best = ev["acceptance"] > best["acceptance"]
        if is_best:
            best = {**ev, "step": step}
        if dp.main:
            rec = {"step": step, "eval": ev, "time_s": round(elapsed_before + time.time() - t0, 1)}
            with open(out / "log.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
        log(f"[eval] step {step}: acceptance {ev['acceptance']:.3f}  per-depth acc {ev['per_depth']}"
            f"{'  (best)' if is_best else ''}")
        return is_best

    t0 = time.time()
    if step > 0:
        best = {"acceptance": 0.0}  # the held-out set may have grown since the checkpoint: score afresh
    save(tag_best=do_eval())
    evaluated_at = step
    model.train()
    sw = slot_weights(cfg.block_size, cfg.loss_gamma)
    log(f"[train] slot loss weights {[round(float(x), 3) for x in sw]}")
    run_loss, run_acc, run_n, t_log = 0.0, 0.0, 0, time.time()
    while step < cfg.steps:
        minutes = (elapsed_before + time.time() - t0) / 60
        if cfg.max_minutes and dp.active:
            minutes = dp.share(minutes)  # one clock for all ranks: the same schedule and the same last step
        if cfg.max_minutes and minutes > cfg.max_minutes:
            log(f"[train] time budget of {cfg.max_minutes} min reached at step {step}")
            break
        ks = torch.randint(0, len(train_ds), (cfg.seqs_per_step,), generator=gen).tolist()
        rows = draw_blocks(train_ds, ks, cfg.anchors_per_seq, cfg.block_size, gen)
        if len(rows) < dp.world:  # every rank needs a share (the same decision on all ranks)
            continue
        labels, t_ids = block_targets(train_ds, rows, cfg.anchors_per_seq, cfg.block_size)  # the global batch
        vocab_ids = loss_vocab(static_vocab, labels, t_ids, V, cfg.vocab_negatives, gen)
        total = weight_total(labels, cfg.loss_gamma)
        batch = to_device(pack_blocks(train_ds, dp.share_of(rows), cfg.anchors_per_seq, cfg.block_size,
                                      mask_token_id), device)
        lr = lr_at(step, cfg, minutes)
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
            h = forward(batch)
            loss, info = block_loss(h, batch, lm_weight, cfg, vocab_ids, total)
        opt.zero_grad(set_to_none=True)
        (loss * dp.world).backward()  # DDP averages over the ranks; their losses add up to the global batch's
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        stats = dp.sum(torch.stack([loss.detach().float(), info["acc"].float()])).tolist()
        run_loss += stats[0]
        run_acc += stats[1]
        run_n += 1
        if step % cfg.log_every == 0 or step == cfg.steps:
            dt = (time.time() - t_log) / run_n
            rec = {"step": step, "loss": round(run_loss / run_n, 6), "train_acc": round(run_acc / run_n, 4),
                   "lr": lr, "s_per_step": round(dt, 3), "time_s": round(elapsed_before + time.time() - t0, 1)}
            if dp.main:
                with open(out / "log.jsonl", "a") as f:
                    f.write(json.dumps(rec) + "\n")
            log(f"[train] step {step}/{cfg.steps}  loss {rec['loss']:.4f}  slot-acc {rec['train_acc']:.3f}  "
                f"lr {lr:.2e}  {dt:.2f}s/step")
            run_loss, run_acc, run_n, t_log = 0.0, 0.0, 0, time.time()
        if step % cfg.eval_every == 0 or step == cfg.steps:
            if reload is not None:
                fresh = reload()
                if fresh is not None:
                    train_ds, heldout_ds = fresh
                    ranked = train_ds.ranked_vocab(V)
                    static_vocab = frequent_vocab(ranked, cfg.vocab_subset)
                    best = {"acceptance": 0.0}  # a new held-out set: scores are not comparable to earlier ones
                    log(f"[train] data reloaded: train {len(train_ds)} seqs ({train_ds.response_tokens()} "
                        f"response tokens), held-out {len(heldout_ds)} seqs")
            is_best = do_eval()
            evaluated_at = step
            save(tag_best=is_best)
        elif step % cfg.save_every == 0:
            save()
    if evaluated_at != step:  # stopped by the time budget between evaluations
        is_best = do_eval()
        save(tag_best=is_best)
    dp.barrier()  # the export is on disk before any rank goes on to use it
    log(f"[train] done: {step} steps, best held-out acceptance {best['acceptance']:.3f} at step {best.get('step')}")
    return best


def _quiet(msg: str) -> None:
    """Ranks other than 0 log nothing (rank 0 speaks for all)."""
