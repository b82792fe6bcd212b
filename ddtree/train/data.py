"""Training data for a DFlash drafter: token sequences plus cached target features.

The target is frozen, so everything the drafter learns from is computed ONCE:

1. sequences: either self-distillation (the target's own greedy or sampled
   responses to prompts, through its chat template when it has one) or plain
   text cut into windows;
2. one prefill of the target over each sequence gives the context features
   (``hidden_states[i + 1]`` for ``i`` in ``layer_ids``, concatenated) and the
   teacher's top-k log-probs for the next token at every position.

Shards are written to ``<dir>/shard_XXXXX.pt`` as they are produced, so a
killed run resumes where it stopped.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ddtree.drafters.features import extract_context_feature
from ddtree.targets.cache import cache_kwargs


@dataclass
class Sequence_:
    ids: list[int]
    prompt_len: int  # anchors are only drawn at positions >= prompt_len (the response)


def encode_prompt(tokenizer, prompt: str | list[dict]) -> list[int]:
    """Token ids of a user prompt, through the chat template when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)
    text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
    return tokenizer(text)["input_ids"]


@torch.no_grad()
def generate_with_features(
    target,
    prompt_ids: Sequence[Sequence[int]],
    layer_ids: Sequence[int],
    topk: int,
    *,
    max_new_tokens: int,
    eos_token_id: int | None,
    pad_token_id: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> dict:
    """Batched continuation (greedy when ``temperature == 0``) that records what training needs.

    One pass does it all: the prompt prefill and every decode step return the
    hidden states of the tokens they consume (the context features) and the
    logits for the next token (the teacher's top-k). Responses are cut after the
    first ``eos_token_id`` (kept). Returns a shard dict (see :func:`merge_shards`).
    """
    from transformers import DynamicCache

    device = target.get_input_embeddings().weight.device
    bsz = len(prompt_ids)
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((bsz, width), pad_token_id, dtype=torch.long, device=device)
    attn = torch.zeros((bsz, width), dtype=torch.long, device=device)
    for b, p in enumerate(prompt_ids):
        ids[b, width - len(p):] = torch.tensor(p, device=device)
        attn[b, width - len(p):] = 1
    cache = DynamicCache(config=target.config)
    new_tok: list[list[int]] = [[] for _ in range(bsz)]
    feats: list[list[torch.Tensor]] = [[] for _ in range(bsz)]
    t_ids: list[list[torch.Tensor]] = [[] for _ in range(bsz)]
    t_lp: list[list[torch.Tensor]] = [[] for _ in range(bsz)]
    done = torch.zeros(bsz, dtype=torch.bool, device=device)
    cur_ids, cur_attn = ids, attn
    for step in range(max_new_tokens):
        pos = (cur_attn.cumsum(-1) - 1).clamp(min=0)[:, -cur_ids.shape[1]:]
        res = target(input_ids=cur_ids, attention_mask=cur_attn, position_ids=pos, use_cache=True,
                     **cache_kwargs(target, cache), logits_to_keep=1, output_hidden_states=True)
        f = extract_context_feature(res.hidden_states, layer_ids).float().cpu()
        logits = res.logits[:, -1].float()
        lp = torch.log_softmax(logits, dim=-1)
        tv, ti = lp.topk(topk, dim=-1)
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        else:
            nxt = logits.argmax(-1)
        for b in range(bsz):
            if done[b]:
                continue
            if step == 0:
                n = len(prompt_ids[b])
                feats[b].append(f[b, width - n:])
                pad_ids = torch.zeros(n - 1, topk, dtype=torch.int32)
                t_ids[b].append(pad_ids)  # prompt positions: no teacher needed (never a slot target)
                t_lp[b].append(torch.full((n - 1, topk), -1e4, dtype=torch.float16))
            else:
                feats[b].append(f[b, -1:])
            t_ids[b].append(ti[b:b + 1].to(torch.int32).cpu())
            t_lp[b].append(tv[b:b + 1].to(torch.float16).cpu())
            new_tok[b].append(int(nxt[b]))
        if eos_token_id is not None:
            done |= nxt == eos_token_id
        if bool(done.all()):
            break
        cur_ids = nxt.masked_fill(done, pad_token_id)[:, None]
        cur_attn = torch.cat([cur_attn, torch.ones((bsz, 1), dtype=cur_attn.dtype, device=device)], dim=1)
    seqs, fl, il, ll = [], [], [], []
    for b in range(bsz):
        full = list(prompt_ids[b]) + new_tok[b]
        f_b = torch.cat(feats[b])  # features of every token fed to the target (all but the last)
        f_b = torch.cat([f_b, torch.zeros(len(full) - len(f_b), f_b.shape[1])])
        seqs.append(Sequence_(full, len(prompt_ids[b])))
        fl.append(f_b.to(torch.bfloat16))
        # teacher rows exist for positions 0 .. len-2 (the last token predicts nothing we keep)
        il.append(torch.cat(t_ids[b] + [torch.zeros(1, topk, dtype=torch.int32)]))
        ll.append(torch.cat(t_lp[b] + [torch.full((1, topk), -1e4, dtype=torch.float16)]))
        assert len(il[-1]) == len(full) and len(fl[-1]) == len(full)
    return _pack(seqs, fl, il, ll, layer_ids)


def _pack(seqs, feats, topk_ids, topk_lp, layer_ids) -> dict:
    lens = [len(s.ids) for s in seqs]
    return {
        "input_ids": torch.cat([torch.tensor(s.ids, dtype=torch.int32) for s in seqs]),
        "offsets": torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.long),
        "prompt_lens": torch.tensor([s.prompt_len for s in seqs], dtype=torch.long),
        "features": torch.cat(feats),
        "topk_ids": torch.cat(topk_ids),
        "topk_logprobs": torch.cat(topk_lp),
        "layer_ids": list(layer_ids),
    }


def self_distill_jobs(
    target,
    tokenizer,
    prompts: Sequence,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 32,
    temperature: float = 0.0,
    seed: int = 0,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> list:
    """Callables ``job(layer_ids, topk) -> shard``, one per batch of prompts: the target's own responses.

    ``prompts`` are strings / message lists (encoded with the chat template) or lists of token ids.
    """
    enc = [list(p) if isinstance(p, (list, tuple)) and p and isinstance(p[0], int) else encode_prompt(tokenizer, p)
           for p in prompts]
    eos = eos_token_id if eos_token_id is not None else (tokenizer.eos_token_id if tokenizer is not None else None)
    pad = pad_token_id if pad_token_id is not None else (
        tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else (eos or 0))
    # group prompts of similar length to waste little compute on padding
    order = sorted(range(len(enc)), key=lambda i: len(enc[i]))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]

    def job(idx, bi, layer_ids, topk):
        gen = torch.Generator().manual_seed(seed * 100_003 + bi)
        return generate_with_features(target, [enc[i] for i in idx], layer_ids, topk, max_new_tokens=max_new_tokens,
                                      eos_token_id=eos, pad_token_id=pad, temperature=temperature, generator=gen)

    return [lambda layer_ids, topk, idx=idx, bi=bi: job(idx, bi, layer_ids, topk) for bi, idx in enumerate(batches)]


def plain_text_jobs(target, tokenizer, texts: Iterable[str], seq_len: int = 512, batch_size: int = 32,
                    max_tokens: int = 500_000) -> list:
    """Callables ``job(layer_ids, topk) -> shard`` over plain-text windows of ``seq_len`` tokens."""
    buf: list[int] = []
    seqs: list[Sequence_] = []
    total = 0
    for text in texts:
        buf.extend(tokenizer(text)["input_ids"])
        while len(buf) >= seq_len and total < max_tokens:
            seqs.append(Sequence_(buf[:seq_len], min(16, seq_len // 4)))
            buf = buf[seq_len:]
            total += seq_len
        if total >= max_tokens:
            break

    def job(batch, layer_ids, topk):
        return merge_shards([target_features(target, batch[j:j + 8], layer_ids, topk) for j in range(0, len(batch), 8)])

    return [lambda layer_ids, topk, b=seqs[i:i + batch_size]: job(b, layer_ids, topk)
            for i in range(0, len(seqs), batch_size)]


def read_texts(paths: Sequence[str], seed: int = 0) -> Iterable[str]:
    """Texts of the given files and of the ``.py`` / ``.txt`` files under the given folders (shuffled)."""
    import random

    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(f for ext in ("*.py", "*.txt") for f in p.rglob(ext)) if p.is_dir() else [p]
    random.Random(seed).shuffle(files)
    for f in files:
        try:
            yield f.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue


@torch.no_grad()
def target_features(target, seqs: Sequence[Sequence_], layer_ids: Sequence[int], topk: int,
                    chunk: int = 2048) -> dict:
    """One right-padded prefill: context features and teacher top-k next-token log-probs per position."""
    device = target.get_input_embeddings().weight.device
    lens = [len(s.ids) for s in seqs]
    width = max(lens)
    ids = torch.zeros((len(seqs), width), dtype=torch.long, device=device)
    attn = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, :lens[b]] = torch.tensor(s.ids, device=device)
        attn[b, :lens[b]] = 1
    out = target(input_ids=ids, attention_mask=attn, output_hidden_states=True, use_cache=False, logits_to_keep=1)
    feats = extract_context_feature(out.hidden_states, layer_ids)
    last = out.hidden_states[-1]
    lm_head = target.get_output_embeddings()
    f_list, ti_list, tl_list = [], [], []
    for b, n in enumerate(lens):
        f_list.append(feats[b, :n].to(torch.bfloat16).cpu())
        h = last[b, :n]
        ids_b, lp_b = [], []
        for s in range(0, n, chunk):
            lp = torch.log_softmax(lm_head(h[s:s + chunk]).float(), dim=-1)
            v, i = lp.topk(topk, dim=-1)
            ids_b.append(i.to(torch.int32).cpu())
            lp_b.append(v.to(torch.float16).cpu())
        ti_list.append(torch.cat(ids_b))
        tl_list.append(torch.cat(lp_b))
    return _pack(seqs, f_list, ti_list, tl_list, layer_ids)


def build_dataset(out_dir: str | Path, jobs: Sequence, layer_ids: Sequence[int], topk: int, log=print,
                  worker: int = 0, num_workers: int = 1) -> Path:
    """Write one feature shard per job (``job(layer_ids, topk) -> shard dict``).

    Existing shards are kept and their jobs skipped, so an interrupted build
    resumes; ``worker``/``num_workers`` split the jobs between processes.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    n_tok = 0
    for i, job in enumerate(jobs):
        path = out_dir / f"shard_{i:05d}.pt"
        if path.exists() or i % num_workers != worker:
            continue
        shard = job(layer_ids, topk)
        tmp = out_dir / f".shard_{i:05d}.pt.tmp"
        torch.save(shard, str(tmp))
        tmp.rename(path)
        resp = int(sum(int(shard["offsets"][k + 1] - shard["offsets"][k] - shard["prompt_lens"][k])
                       for k in range(len(shard["prompt_lens"]))))
        n_tok += resp
        el = time.time() - t0
        log(f"[data] shard {i + 1}/{len(jobs)}: {len(shard['prompt_lens'])} seqs, {resp} response tokens "
            f"({n_tok} this run, {n_tok / max(el, 1e-6):.1f} tok/s, {el:.0f}s)")
    return out_dir


def merge_shards(shards: Sequence[dict]) -> dict:
    offs, base = [torch.zeros(1, dtype=torch.long)], 0
    for s in shards:
        offs.append(s["offsets"][1:] + base)
        base += int(s["offsets"][-1])
    return {
        "input_ids": torch.cat([s["input_ids"] for s in shards]),
        "offsets": torch.cat(offs),
        "prompt_lens": torch.cat([s["prompt_lens"] for s in shards]),
        "features": torch.cat([s["features"] for s in shards]),
        "topk_ids": torch.cat([s["topk_ids"] for s in shards]),
        "topk_logprobs": torch.cat([s["topk_logprobs"] for s in shards]),
        "layer_ids": list(shards[0]["layer_ids"]),
    }


DIR_KEY_STRIDE = 100_000_000  # a sequence's key // DIR_KEY_STRIDE is the index of its cache folder


def load_dataset(data_dir: str | Path) -> dict:
    """All shards of one or more cache folders (comma-separated), merged, with a stable key per sequence."""
    shards = []
    for d_i, d in enumerate(str(data_dir).split(",")):
        files = sorted(Path(d).glob("shard_*.pt"))
        for f in files:
            sh = torch.load(f, weights_only=True)
            n = len(sh["prompt_lens"])
            shard_no = int(f.stem.split("_")[1])
            sh["keys"] = torch.arange(n, dtype=torch.long) + shard_no * 10_000 + d_i * DIR_KEY_STRIDE
            shards.append(sh)
    if not shards:
        raise FileNotFoundError(f"no feature shards in {data_dir}: build the dataset first")
    data = merge_shards(shards)
    data["keys"] = torch.cat([s["keys"] for s in shards])
    return data


class FeatureDataset:
    """Cached sequences with their features; draws random anchor blocks for training."""

    def __init__(self, data: dict, seq_index: Sequence[int] | None = None, feature_layers: Sequence[int] | None = None):
        self.data = data
        self.offsets = data["offsets"]
        n = len(self.offsets) - 1
        self.seq_index = list(seq_index) if seq_index is not None else list(range(n))
        self.layer_ids = list(data["layer_ids"])
        # choose a subset of the cached layers (columns of the feature matrix)
        if feature_layers is not None and list(feature_layers) != self.layer_ids:
            h = data["features"].shape[1] // len(self.layer_ids)
            cols = torch.cat([torch.arange(self.layer_ids.index(i) * h, (self.layer_ids.index(i) + 1) * h)
                              for i in feature_layers])
            self.features = data["features"][:, cols].contiguous()
            self.layer_ids = list(feature_layers)
        else:
            self.features = data["features"]

    def __len__(self) -> int:
        return len(self.seq_index)

    def response_tokens(self) -> int:
        o, p = self.offsets, self.data["prompt_lens"]
        return int(sum(int(o[i + 1] - o[i] - p[i]) for i in self.seq_index))

    def ranked_vocab(self, vocab_size: int) -> torch.Tensor:
        """All token ids, most frequent first in these sequences (plus the teacher's top-4), ties by id.

        Low ids come first among unseen tokens: BPE ids roughly follow merge order, hence frequency.
        """
        rows = torch.cat([torch.arange(s, s + n) for s, n, _ in map(self.sequence, range(len(self)))])
        counts = torch.bincount(self.data["input_ids"][rows].long(), minlength=vocab_size).double()
        counts += torch.bincount(self.data["topk_ids"][rows, :4].flatten().long(), minlength=vocab_size)
        return torch.sort(-counts, stable=True).indices[:vocab_size]

    def sequence(self, k: int) -> tuple[int, int, int]:
        """``(start, length, prompt_len)`` of the k-th sequence in the flat arrays."""
        i = self.seq_index[k]
        s, e = int(self.offsets[i]), int(self.offsets[i + 1])
        return s, e - s, int(self.data["prompt_lens"][i])


def split_train_heldout(data: dict, heldout_frac: float, seed: int = 0) -> tuple[list[int], list[int]]:
    """Held-out sequences chosen by a hash of their stable key, so adding shards never moves one into training."""
    n = len(data["offsets"]) - 1
    keys = data.get("keys", torch.arange(n))
    h = ((keys + seed * 7919) * 2654435761) % (2**32)
    held = (h.double() / 2**32) < heldout_frac
    if n > 1 and not bool(held.any()):
        held[int(h.argmin())] = True
    if bool(held.all()):
        held[int(h.argmax())] = False
    idx = torch.arange(n)
    return idx[~held].tolist(), idx[held].tolist()
