"""Command-line entry: build (or reuse) the feature cache, then train and export.

Example (the shipped SmolLM2 drafter; see models/smollm2-135m-dflash/README.md)::

    python -m ddtree.train --target smollm2 --out-dir runs/smollm2 --num-prompts 2000 --steps 3000
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from ddtree.runtime.threads import ThreadInfo, configure_threads
from ddtree.train.config import TrainConfig, parse_args
from ddtree.train.data import (
    DIR_KEY_STRIDE,
    FeatureDataset,
    build_dataset,
    load_dataset,
    plain_text_jobs,
    read_texts,
    self_distill_jobs,
    split_train_heldout,
)
from ddtree.train.layers import choose_layer_ids
from ddtree.train.loop import train
from ddtree.train.parallel import DataParallel


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def load_target(cfg: TrainConfig, device: str = "cpu"):
    """The frozen target and its tokenizer, in ``--target-dtype`` on ``device``."""
    dtype = cfg.resolved_target_dtype(device)
    if cfg.target == "smollm2":
        from ddtree.loading.pretrained import load_default_target

        model, tokenizer = load_default_target(dtype=dtype)
        return model.to(device).eval(), tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=dtype).to(device).eval()
    return model, AutoTokenizer.from_pretrained(cfg.target)


def pick_mask_token(tokenizer, vocab_size: int, used: torch.Tensor | None = None) -> int:
    """A token for the masked slots: the tokenizer's mask token, else an unused special token, else the last id."""
    if tokenizer is not None:
        if getattr(tokenizer, "mask_token_id", None) is not None:
            return int(tokenizer.mask_token_id)
        skip = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
        seen = set(used.unique().tolist()) if used is not None else set()
        cands = [i for i in sorted(getattr(tokenizer, "all_special_ids", [])) if i not in skip and i not in seen]
        added = sorted(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        cands += [i for i in added if i not in skip and i not in seen and i not in cands]
        cands = [i for i in cands if i < vocab_size]
        if cands:
            return int(cands[-1])
    return vocab_size - 1


def layer_ids_for(cfg: TrainConfig, target) -> tuple[list[int], list[int]]:
    """``(the layers the drafter reads, the layers the cache holds)`` for ``target`` (a model or its config);
    see :mod:`ddtree.train.layers`."""
    return choose_layer_ids(num_target_layers(target), cfg.num_feature_layers, cfg.target_layer_ids,
                            cfg.cache_layer_ids)


def num_target_layers(target) -> int:
    config = getattr(target, "config", target)
    tc = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(tc.num_hidden_layers)


def target_config(cfg: TrainConfig):
    """The target's config alone (no weights), to check the layer flags before the weights load."""
    from transformers import AutoConfig

    if cfg.target == "smollm2":
        from ddtree.loading.pretrained import smollm2_path

        return AutoConfig.from_pretrained(str(smollm2_path()))
    return AutoConfig.from_pretrained(cfg.target)


def prepare_data(cfg: TrainConfig, target, tokenizer, prompts=None, cache_ids=None, worker: int = 0,
                 num_workers: int = 1, dp: DataParallel | None = None) -> Path:
    """Build the feature cache in ``data_dir`` (resumes a partial build).

    Under ``torchrun`` (``dp`` active) the ranks are the workers: each builds its shards, rank 0 writes
    the cache's metadata, and all return once the cache is complete.
    """
    if dp is not None and dp.active:
        if worker < 0:
            return Path(cfg.resolved_data_dir())
        if num_workers > 1:
            raise ValueError("--data-workers splits the cache between separate commands; under torchrun the ranks "
                             "split it: leave --data-workers at 1")
        data_dir = _prepare_ranked(cfg, target, tokenizer, prompts, cache_ids, dp)
        return data_dir
    if worker < 0:  # use the cache as it is (shards may still be arriving from data workers)
        return Path(cfg.resolved_data_dir())
    return _build_cache(cfg, target, tokenizer, prompts, cache_ids, worker, num_workers)


def _build_cache(cfg, target, tokenizer, prompts, cache_ids, worker: int, num_workers: int, *, write_meta=True,
                 sync=None, log=log) -> Path:
    """Check the cache's metadata against the run, then build this worker's missing shards."""
    data_dir = Path(cfg.resolved_data_dir())
    meta_path = data_dir / "meta.json"
    meta = {"source": cfg.source, "target": cfg.target, "layer_ids": cache_ids, "topk": cfg.topk,
            "num_prompts": cfg.num_prompts, "prompt_offset": cfg.prompt_offset, "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "seed": cfg.seed}
    if cfg.prompt_set != "templates":
        meta["prompt_set"] = cfg.prompt_set
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        diff = {k: (old.get(k), v) for k, v in meta.items() if old.get(k) != v}
        if diff and any(data_dir.glob("shard_*.pt")):
            said = ", ".join(f"{k}: cache has {a}, run asks for {b}" for k, (a, b) in diff.items())
            raise ValueError(f"the feature cache in {data_dir} was built with other settings ({said}); "
                             "repeat those settings to extend it, or pass a new --data-dir")
        if old.get("complete") and not diff:
            return data_dir
    if cfg.source == "self-distill":
        if prompts is None:
            from ddtree.train.prompts import natural_prompts, training_prompts

            sets = {"templates": training_prompts, "natural": natural_prompts}
            if cfg.prompt_set not in sets:
                raise ValueError(f"unknown --prompt-set {cfg.prompt_set!r}: use templates or natural")
            prompts = sets[cfg.prompt_set](cfg.prompt_offset + cfg.num_prompts, seed=cfg.seed)[cfg.prompt_offset:]
        jobs = self_distill_jobs(target, tokenizer, prompts, max_new_tokens=cfg.max_new_tokens,
                                 batch_size=cfg.gen_batch, temperature=cfg.temperature, seed=cfg.seed)
    elif cfg.source == "text":
        if not cfg.text_paths:
            raise ValueError("--source text needs --text-paths (files or folders of .py/.txt)")
        jobs = plain_text_jobs(target, tokenizer, read_texts(cfg.text_paths, cfg.seed), cfg.seq_len, cfg.gen_batch,
                               cfg.max_text_tokens)
    else:
        raise ValueError(f"unknown --source {cfg.source!r}: use self-distill or text")
    data_dir.mkdir(parents=True, exist_ok=True)
    if write_meta:
        _write_json(meta_path, meta)
    if sync is not None:
        sync()  # the metadata is checked and written before any rank adds a shard
    log(f"[data] building the feature cache in {data_dir}: {len(jobs)} shards, layers {cache_ids}")
    build_dataset(data_dir, jobs, cache_ids, cfg.topk, log=log, worker=worker, num_workers=num_workers)
    if sync is not None:
        sync()  # every rank's shards are on disk
    elif num_workers > 1 and len(list(data_dir.glob("shard_*.pt"))) < len(jobs):
        return data_dir  # other workers are still building
    if write_meta:
        _write_json(meta_path, {**meta, "complete": True})
    return data_dir


def _write_json(path: Path, obj) -> None:
    """Written whole or not at all (other ranks may be reading it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    tmp.replace(path)


def _prepare_ranked(cfg, target, tokenizer, prompts, cache_ids, dp: DataParallel) -> Path:
    """The cache built by the torchrun ranks together (shard i on rank i % world)."""
    data_dir = _build_cache(cfg, target, tokenizer, prompts, cache_ids, dp.rank, dp.world, write_meta=dp.main,
                            sync=dp.barrier, log=log if dp.main else _quiet)
    dp.barrier()  # rank 0 has marked the cache complete
    return data_dir


def _quiet(msg: str) -> None:
    """Ranks other than 0 log nothing."""


THREADS_FIX = "python -m ddtree.train --threads 1, or OMP_NUM_THREADS=1"
"""How a training run takes fewer threads: what a shared-CPU warning raised anywhere in the run names."""


def pick_threads(cfg: TrainConfig) -> ThreadInfo:
    """torch's CPU threads for the run, by the policy the demo, chat and bench apply
    (:func:`~ddtree.runtime.threads.configure_threads`): ``--threads`` when given, else ``OMP_NUM_THREADS``,
    else the physical cores other processes leave free, split between torchrun's ranks on this machine
    (``LOCAL_WORLD_SIZE``). Torch's default, one thread per CPU, crawls on a shared CPU."""
    return configure_threads(cfg.threads or None, fix=THREADS_FIX,
                             processes=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def run(cfg: TrainConfig, target=None, tokenizer=None, prompts=None, log_fn=log, eval_prompts=None) -> dict:
    """Data (cached) + training + the export's acceptance through ddtree's generation.

    Returns the best held-out eval; on rank 0, with ``"inference"``: what :func:`final_acceptance` measured.
    The drafter is written to ``out_dir/best``. Under ``torchrun`` every rank calls this (see
    :mod:`ddtree.train.parallel`). ``prompts`` replace the generated training prompts, ``eval_prompts`` the
    held-out ones (token-id lists, text or message lists).
    """
    threads = pick_threads(cfg)
    dp = DataParallel.from_env()
    device = cfg.resolved_device(dp.local_rank if dp.active else None)
    dp.start(device)
    if dp.main:
        log_fn(f"[threads] {threads.describe()}")
    result = _run(cfg, target, tokenizer, prompts, log_fn if dp.main else _quiet, eval_prompts, device, dp)
    dp.stop()
    return result


def _run(cfg: TrainConfig, target, tokenizer, prompts, log_fn, eval_prompts, device: str, dp: DataParallel) -> dict:
    if target is None:
        layer_ids_for(cfg, target_config(cfg))  # a bad layer flag fails before the weights load
        target, tokenizer = load_target(cfg, device)
    target.to(device).eval()
    ids, cache_ids = layer_ids_for(cfg, target)
    if not cfg.target_layer_ids and len(ids) < cfg.num_feature_layers:
        log_fn(f"[train] the target has {num_target_layers(target)} decoder layers: the drafter reads {len(ids)} "
               f"of them, {ids}, not --num-feature-layers {cfg.num_feature_layers} (never the last layer when "
               "another exists)")
    data_dir = prepare_data(cfg, target, tokenizer, prompts, cache_ids, cfg.data_worker, cfg.data_workers, dp=dp)
    if cfg.data_only:
        log_fn(f"[data] feature cache ready in {data_dir}")
        return {}
    data = load_dataset(data_dir)
    tr, ho = split_for_run(data, data_dir, cfg)
    train_ds = FeatureDataset(data, tr, feature_layers=ids)
    heldout_ds = FeatureDataset(data, ho, feature_layers=ids)
    vocab = target.get_output_embeddings().weight.shape[0]
    mask_id = cfg.mask_token_id if cfg.mask_token_id >= 0 else pick_mask_token(tokenizer, vocab, data["input_ids"])
    if dp.main:
        (Path(cfg.out_dir)).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out_dir) / "train_config.json").write_text(json.dumps(vars(cfg), indent=2))
    state = {"n": len(list(_shard_files(data_dir)))}

    def reload():
        n = len(list(_shard_files(data_dir)))
        if not cfg.reload_data or n == state["n"]:
            return None
        state["n"] = n
        d = load_dataset(data_dir)
        tr_, ho_ = split_for_run(d, data_dir, cfg)
        return FeatureDataset(d, tr_, feature_layers=ids), FeatureDataset(d, ho_, feature_layers=ids)

    best = train(cfg, target, train_ds, heldout_ds, mask_id, log=log_fn, reload=reload, device=device, dp=dp)
    if dp.main and cfg.accept_prompts > 0:
        best["inference"] = final_acceptance(cfg, target, tokenizer, best, eval_prompts, log_fn)
    return best


def final_acceptance(cfg: TrainConfig, target, tokenizer, best: dict, eval_prompts=None, log_fn=log) -> dict:
    """Run the exported drafter (``out_dir/best``) through ddtree's generation on held-out prompts, beside the
    training estimate; written to ``out_dir/acceptance.json`` and ``log.jsonl``."""
    from ddtree.train.acceptance import check_export
    from ddtree.train.prompts import load_eval_prompts

    out = Path(cfg.out_dir)
    prompts = list(eval_prompts) if eval_prompts is not None else load_eval_prompts()
    prompts = prompts[:cfg.accept_prompts]
    res = check_export(out / "best", target, tokenizer, prompts, estimate=best["acceptance"],
                       max_new_tokens=cfg.accept_new_tokens, tree_budget=cfg.accept_tree_budget,
                       gap_fraction=cfg.accept_gap)
    res["step"] = best.get("step")
    (out / "acceptance.json").write_text(json.dumps(res, indent=2))
    with open(out / "log.jsonl", "a") as f:
        f.write(json.dumps({"step": best.get("step"), "inference": res}) + "\n")
    log_fn(f"[accept] {out / 'best'} in ddtree's generation, {res['prompts']} held-out prompts x "
           f"{res['max_new_tokens']} tokens: chain {res['chain']:.3f} (held-out estimate {res['estimate']:.3f}), "
           f"best_first@{res['tree_budget']} {res['tree']:.3f}")
    if res["gap"]:
        log_fn(f"[accept] GAP: {res['gap']}")
    for line in res["config_problems"]:
        log_fn(f"[accept] config check: {line}")
    if not res["config_problems"]:
        log_fn("[accept] config check: no warnings or errors")
    return res


def split_for_run(data: dict, data_dir, cfg: TrainConfig) -> tuple[list[int], list[int]]:
    """Train / held-out split; held-out sequences come only from self-distilled caches when there are any.

    The held-out acceptance estimates how well the drafter follows the target's own answers, so text
    caches (teacher-forced labels on text the target did not write) only ever train.
    """
    tr, ho = split_train_heldout(data, cfg.heldout_frac, seed=cfg.seed)
    dirs = str(data_dir).split(",")
    text = [i for i, d in enumerate(dirs) if _cache_source(d) == "text"]
    if not text or len(text) == len(dirs):
        return tr, ho
    keys = data["keys"]
    moved = [i for i in ho if int(keys[i]) // DIR_KEY_STRIDE in text]
    gone = set(moved)
    return sorted(tr + moved), [i for i in ho if i not in gone]


def _cache_source(d: str) -> str:
    meta = Path(d) / "meta.json"
    return json.loads(meta.read_text()).get("source", "self-distill") if meta.exists() else "self-distill"


def _shard_files(data_dir):
    for d in str(data_dir).split(","):
        yield from Path(d).glob("shard_*.pt")


def main(argv=None) -> int:
    cfg = parse_args(argv)
    log(f"[ddtree.train] {json.dumps(vars(cfg))}")
    best = run(cfg)
    if cfg.data_only or not best:
        return 0
    log(f"[ddtree.train] best drafter: {Path(cfg.out_dir) / 'best'} (held-out acceptance {best['acceptance']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
