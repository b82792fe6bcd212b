"""Summarise a training run as markdown (loss curve table, held-out acceptance) and export its best drafter.

    python -m ddtree.train.report runs/smollm2                 # print the summary
    python -m ddtree.train.report runs/smollm2 --export DIR    # copy best/ (config.json, model.safetensors,
                                                               # ddtree_draft_vocab.json) to DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from ddtree.drafters.dflash.checkpoint import (
    DRAFT_VOCAB_FILE,
    LEGACY_DRAFT_VOCAB_FILE,
    draft_vocab_file,
    load_draft_vocab,
    save_draft_vocab,
)


def read_log(out_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """``(training steps, held-out evaluations)`` of a run's log.jsonl (see :func:`read_inference` for the rest)."""
    train, evals = [], []
    for line in (Path(out_dir) / "log.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "eval" in rec:
            evals.append(rec)
        elif "loss" in rec:
            train.append(rec)
    return train, evals


def read_inference(out_dir: str | Path) -> list[dict]:
    """The exported drafter's acceptance measured through ddtree's generation, one record per measurement."""
    lines = (Path(out_dir) / "log.jsonl").read_text().splitlines()
    return [rec["inference"] for rec in map(json.loads, lines) if "inference" in rec]


def loss_table(train: list[dict], rows: int = 16) -> str:
    if not train:
        return "(no training steps logged)\n"
    stride = max(1, len(train) // rows)
    picked = train[::stride]
    if picked[-1] is not train[-1]:
        picked.append(train[-1])
    out = ["| step | time (min) | loss | train slot acc (weighted) | lr |", "|---:|---:|---:|---:|---:|"]
    for r in picked:
        out.append(f"| {r['step']} | {r['time_s'] / 60:.1f} | {r['loss']:.3f} | {r['train_acc']:.3f} | {r['lr']:.2e} |")
    return "\n".join(out) + "\n"


def eval_table(evals: list[dict]) -> str:
    if not evals:
        return "(no evaluations logged)\n"
    depth = len(evals[0]["eval"]["per_depth"])
    per_depth = " | ".join(f"acc@{d}" for d in range(1, depth + 1))
    head = "| step | time (min) | held-out blocks | acceptance | " + per_depth + " |"
    out = [head, "|" + "---:|" * (4 + depth)]
    for r in evals:
        e = r["eval"]
        out.append(f"| {r['step']} | {r['time_s'] / 60:.1f} | {e['blocks']} | {e['acceptance']:.3f} | "
                   + " | ".join(f"{x:.3f}" for x in e["per_depth"]) + " |")
    return "\n".join(out) + "\n"


def summary(out_dir: str | Path) -> str:
    out_dir = Path(out_dir)
    train, evals = read_log(out_dir)
    best = max(evals, key=lambda r: r["eval"]["acceptance"]) if evals else None
    parts = ["## Loss curve\n", loss_table(train), "\n## Held-out evaluation\n", eval_table(evals)]
    if best:
        e = best["eval"]
        parts.append(
            f"\nBest: step {best['step']}, expected chain acceptance {e['acceptance']:.3f}; per-depth accuracy "
            f"{e['per_depth']}; P(first d slots all correct) {e.get('reach')}; "
            f"conditional acceptance per depth {e.get('cond')}.\n")
    for res in read_inference(out_dir)[-1:]:
        parts.append(
            f"\n## Through ddtree's generation\n\nThe export of step {res.get('step')} on {res['prompts']} held-out "
            f"prompts x {res['max_new_tokens']} tokens: chain ({res['chain_len']} tokens) **{res['chain']:.3f}**, "
            f"best_first@{res['tree_budget']} **{res['tree']:.3f}**, against the held-out estimate "
            f"{res['estimate']:.3f}.\n")
        if res.get("gap"):
            parts.append(f"\nGap: {res['gap']}.\n")
        for line in res.get("config_problems", []):
            parts.append(f"\nConfig check: {line}\n")
    return "".join(parts)


def export(out_dir: str | Path, dest: str | Path) -> Path:
    src, dest = Path(out_dir) / "best", Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        if (src / name).exists():
            shutil.copyfile(src / name, dest / name)
    (dest / LEGACY_DRAFT_VOCAB_FILE).unlink(missing_ok=True)  # never a *.safetensors sidecar (vLLM reads them all)
    if draft_vocab_file(src) is not None:  # an older run's may have the legacy name: written under the new one
        vocab_size = json.loads((src / "config.json").read_text())["vocab_size"]
        save_draft_vocab(dest, load_draft_vocab(src, vocab_size))
    else:
        (dest / DRAFT_VOCAB_FILE).unlink(missing_ok=True)
    return dest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddtree.train.report")
    p.add_argument("out_dir")
    p.add_argument("--export", action="append", default=[], help="copy the best drafter here (repeatable)")
    a = p.parse_args(argv)
    print(summary(a.out_dir))
    for d in a.export:
        print(f"exported {export(a.out_dir, d)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
