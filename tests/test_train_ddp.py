"""Data-parallel training under torchrun (gloo, 2 CPU ranks) equals one process at the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from test_train import tiny_prompts, tiny_target

import ddtree
from ddtree.train import TrainConfig, run

WORKER = Path(__file__).with_name("train_ddp_worker.py")
RANKS = 2


def ddp_cfg(root: Path, steps: int) -> TrainConfig:
    """Three cache shards (two on rank 0, one on rank 1), the vocabulary-subset loss, a loss record every step."""
    return TrainConfig(target="tiny", out_dir=str(root / "run"), num_prompts=24, max_new_tokens=24, gen_batch=8,
                       topk=8, heldout_frac=0.25, num_layers=1, target_layer_ids=[1, 2], block_size=4,
                       mask_token_id=127, steps=steps, seqs_per_step=6, anchors_per_seq=6, lr=3e-3, min_lr=3e-4,
                       warmup=3, eval_every=6, eval_blocks=64, save_every=6, log_every=1, vocab_subset=48,
                       vocab_negatives=16, autocast="none", device="cpu", threads=0, accept_prompts=0)


def torchrun(*args: str, timeout: float) -> subprocess.CompletedProcess:
    root = str(Path(ddtree.__file__).resolve().parent.parent)
    paths = [root, str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def records(root: Path) -> tuple[list[dict], list[dict]]:
    lines = [json.loads(line) for line in (root / "run" / "log.jsonl").read_text().splitlines()]
    return [r for r in lines if "loss" in r], [r for r in lines if "eval" in r]


def test_two_ranks_train_like_one_process_and_resume(tmp_path):
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    target, prompts = tiny_target(), tiny_prompts(24)
    for steps in (12, 20):  # 12 steps, then a resumed run to 20
        run(ddp_cfg(single, steps), target=target, prompts=prompts, log_fn=lambda m: None)
        proc = torchrun(str(WORKER), str(ddp), str(steps), timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
    # the ranks built the cache between them (shard i on rank i % 2): the same sequences as one process
    for i in range(3):
        a = torch.load(single / "run" / "data" / f"shard_{i:05d}.pt", weights_only=True)
        b = torch.load(ddp / "run" / "data" / f"shard_{i:05d}.pt", weights_only=True)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["features"], b["features"])
    assert json.loads((ddp / "run" / "data" / "meta.json").read_text())["complete"]
    one, two = records(single), records(ddp)
    assert [r["step"] for r in one[0]] == [r["step"] for r in two[0]] == list(range(1, 21))
    loss1 = torch.tensor([r["loss"] for r in one[0]], dtype=torch.float64)
    loss2 = torch.tensor([r["loss"] for r in two[0]], dtype=torch.float64)
    assert loss1[-1] < loss1[0]  # it learns
    torch.testing.assert_close(loss2, loss1, rtol=2e-4, atol=1e-5)
    acc1 = torch.tensor([r["train_acc"] for r in one[0]])
    acc2 = torch.tensor([r["train_acc"] for r in two[0]])
    torch.testing.assert_close(acc2, acc1, rtol=0, atol=2e-3)
    # held-out evaluations (rank 0) at the same steps with the same acceptance; the resumed half resumed
    # a resumed run scores its start afresh
    assert [r["step"] for r in one[1]] == [r["step"] for r in two[1]] == [0, 6, 12, 12, 18, 20]
    for e1, e2 in zip(one[1], two[1]):
        assert abs(e1["eval"]["acceptance"] - e2["eval"]["acceptance"]) < 1e-3, (e1, e2)
    assert torch.load(ddp / "run" / "ckpt.pt", weights_only=False)["step"] == 20
    assert (ddp / "run" / "best" / "model.safetensors").exists()
