"""Scale-out check: a random-weight target at Qwen3-8B widths, tensor-parallel and layer-split, against one device.

Part of ``python -m ddtree.bench.gpu_check`` (its ``scale_out`` entry), and the
worker that check launches under ``torchrun``::

    python -m torch.distributed.run --standalone --nproc_per_node N -m ddtree.bench.scale_out PAIR_DIR OUT_JSON

* tensor parallel: ``from_pretrained(..., tp_plan="auto")`` over every GPU present
  (one GPU: TP=1, the loading path only), NCCL; on the CPU two gloo ranks;
* layer split (two GPUs or more): ``device_map`` puts the first half of the layers
  on GPU 0 and the rest on GPU 1, so the drafter's features come from both.

Each is compared token for token (and acceptance) with the same calls on one
device, in float32 (TF32 off) so that a sharded matmul's reordered sums cannot
flip a greedy choice. Ranks must agree exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ddtree.runtime.distributed import leave_process_group

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=151936)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=97)
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]
CASES = (("chain", 8), ("best_first", 32))


def build_pair(path: Path, widths: dict, layers: int) -> None:
    """Random target (Qwen3) and a one-layer DFlash drafter for it, saved under ``path``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ddtree.drafters.dflash.config import DFlashConfig
    from ddtree.drafters.dflash.model import DFlashDraftModel

    torch.manual_seed(0)
    cfg = Qwen3Config(num_hidden_layers=layers, max_position_embeddings=4096, tie_word_embeddings=False, **widths)
    target = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # a sharper random target: greedy continuations that are not one repeated token
        target.lm_head.weight.mul_(4.0)
    target.save_pretrained(path / "target")
    torch.manual_seed(1)
    dcfg = DFlashConfig.for_target(cfg, num_hidden_layers=1, block_size=8, mask_token_id=widths["vocab_size"] - 1)
    DFlashDraftModel(dcfg).float().eval().save_pretrained(path / "drafter")


def generate_all(gen, new_tokens: int) -> dict:
    """The calls every placement makes: greedy per builder, tokens, acceptance and tokens/s."""
    from ddtree.generation.generator import SpeculativeGenerator

    out = {}
    for builder, budget in CASES:
        g = SpeculativeGenerator(gen.target, gen.drafter, tree_budget=budget, builder=builder, prompt_lookup=False)
        g.generate(PROMPT, max_new_tokens=4)  # warm
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        t0 = time.perf_counter()
        o = g.generate(PROMPT, max_new_tokens=new_tokens)
        sync()
        seconds = time.perf_counter() - t0
        out[f"{builder}@{budget}"] = {"tokens": o.row_tokens[0], "acceptance": o.row_acceptance[0],
                                      "tokens_per_second": round(len(o.row_tokens[0]) / seconds, 2),
                                      "target_device": str(next(gen.target.parameters()).device)}
    return out


def _load(pair: Path, **placement):
    from ddtree.generation.generator import SpeculativeGenerator

    return SpeculativeGenerator.from_pretrained(str(pair / "target"), str(pair / "drafter"), dtype=torch.float32,
                                                cpu_linear=False, prompt_lookup=False, **placement)


def _compare(name: str, got: dict, want: dict) -> list[dict]:
    rows = []
    for case, w in want.items():
        g = got[case]
        first = next((i for i, (a, b) in enumerate(zip(g["tokens"], w["tokens"])) if a != b), None)
        ok = g["tokens"] == w["tokens"] and g["acceptance"] == w["acceptance"]
        rows.append({"placement": name, "case": case, "ok": ok, "first_mismatch": first,
                     "tokens_per_second": g["tokens_per_second"],
                     "one_device_tokens_per_second": w["tokens_per_second"],
                     "target_device": g.get("target_device"),
                     "mean_acceptance": sum(g["acceptance"]) / max(1, len(g["acceptance"]))})
    return rows


def run(device: torch.device, quick: bool = False, timeout: float = 420.0) -> dict:
    """Build the pair, run it on one device, under torchrun TP, and layer-split; rows with ``ok`` per case."""
    cuda = device.type == "cuda"
    gpus = torch.cuda.device_count() if cuda else 0
    widths, layers, new = (QWEN3_8B, 2 if quick else 4, 64) if cuda else (TINY, 4, 24)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    with tempfile.TemporaryDirectory() as tmp:
        pair = Path(tmp)
        build_pair(pair, widths, layers)
        single = _load(pair, device=device)
        want = generate_all(single, new)
        del single
        if cuda:
            torch.cuda.empty_cache()
        report = {"widths": widths, "layers": layers, "new_tokens": new, "one_device": want, "rows": []}
        ranks = max(1, gpus) if cuda else 2
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               "-m", "ddtree.bench.scale_out", str(pair), str(pair / "tp.json")]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        report["tp_ranks"] = ranks
        if proc.returncode != 0:
            raise RuntimeError(f"the tensor-parallel run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
        per_rank = [json.loads((pair / f"tp.json.rank{r}").read_text()) for r in range(ranks)]
        report["rows"] += _compare(f"tp{ranks}", per_rank[0], want)
        report["rows"].append({"placement": f"tp{ranks}", "case": "ranks agree", "ok": all(r == per_rank[0] or
                               _same_but_timing(r, per_rank[0]) for r in per_rank)})
        if gpus >= 2:
            half = layers // 2
            device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 1,
                          **{f"model.layers.{i}": 0 if i < half else 1 for i in range(layers)}}
            split = _load(pair, device_map=device_map)
            report["rows"] += _compare("layer_split_2gpu", generate_all(split, new), want)
        else:
            report["layer_split"] = "skipped: needs two GPUs (features crossing devices)"
    return report


def _same_but_timing(a: dict, b: dict) -> bool:
    return all(a[k]["tokens"] == b[k]["tokens"] and a[k]["acceptance"] == b[k]["acceptance"] for k in b)


def main(argv: list[str] | None = None) -> int:
    """The torchrun worker: load with ``tp_plan="auto"``, run :func:`generate_all`, write ``OUT.rank<r>``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pair, out = Path(argv[0]), argv[1]
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        torch.set_num_threads(1)
    gen = _load(pair, tp_plan="auto")
    new = 64 if torch.cuda.is_available() else 24
    Path(f"{out}.rank{os.environ.get('RANK', '0')}").write_text(json.dumps(generate_all(gen, new)))
    leave_process_group()  # tp_plan made the group; ranks leave it together
    return 0


if __name__ == "__main__":
    sys.exit(main())
