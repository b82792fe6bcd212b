"""Run by tests/test_distributed.py under ``torchrun --nproc_per_node 2`` (gloo, CPU); not a test module.

``python -m torch.distributed.run ... tests/tp_worker.py MODE ROOT``: ROOT holds
the saved tiny pairs (``ROOT/<kind>/target``, ``ROOT/<kind>/drafter``). Each rank
writes ``ROOT/<MODE>_rank<r>.json``; ``checks``, once that is written, ends with
``bad-input``'s uncaught error (whose exit status and messages the test reads).
:func:`cases` is also what the test runs in one process, so both sides make
exactly the same calls.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny import ScriptedDrafter  # noqa: E402

from ddtree import BudgetPolicy, SpeculativeGenerator  # noqa: E402
from ddtree.blocks import AutoBudget  # noqa: E402
from ddtree.drafters.dflash.model import DFlashDraftModel  # noqa: E402
from ddtree.runtime.distributed import (  # noqa: E402
    gather_lists,
    leave_process_group,
    start_data_parallel,
    stop_data_parallel,
)

KINDS = ("llama", "qwen3")
PROMPTS = [[5, 17, 3, 9, 40], [11, 2, 2, 40, 61, 7, 9, 33]]
NEW = 24
DTYPE = torch.float64


def load(root: Path, kind: str, **placement) -> SpeculativeGenerator:
    return SpeculativeGenerator.from_pretrained(str(root / kind / "target"), str(root / kind / "drafter"),
                                                dtype=DTYPE, prompt_lookup=False, **placement)


def _pack(out) -> dict:
    return {"tokens": out.row_tokens, "acceptance": out.acceptance_lengths, "budgets": out.stats.budgets}


def cases(gen: SpeculativeGenerator) -> dict:
    """Greedy chain/best_first (DFlash drafter, one prompt and a left-padded batch; a scripted drafter with a
    decoy, for acceptance above 1), the DFlash tree with a prompt-lookup branch, and seeded sampling: what must
    equal the single-process run. Every generator says ``prompt_lookup`` (the worker runs the library's default,
    the single-process run the suite's)."""
    target, drafter = gen.target, gen.drafter
    vocab = target.get_input_embeddings().weight.shape[0]
    out = {}
    for builder, budget in (("chain", 4), ("best_first", 8)):
        g = SpeculativeGenerator(target, drafter, tree_budget=budget, builder=builder, prompt_lookup=False)
        for i, p in enumerate(PROMPTS):
            out[f"{builder}/dflash/{i}"] = _pack(g.generate(p, max_new_tokens=NEW))
        out[f"{builder}/dflash/batch"] = _pack(g.generate(PROMPTS, max_new_tokens=12))
    plain = SpeculativeGenerator(target, drafter, tree_budget=0, prompt_lookup=False).generate(PROMPTS[1],
                                                                                                max_new_tokens=40)
    out["plain"] = _pack(plain)
    scripted = ScriptedDrafter(plain.sequences[0].cpu(), vocab=vocab, block_size=5, decoy_at={2: 0})
    for builder, budget in (("chain", 4), ("best_first", 8)):
        g = SpeculativeGenerator(target, scripted, tree_budget=budget, builder=builder, prompt_lookup=False)
        out[f"{builder}/scripted"] = _pack(g.generate(PROMPTS[1], max_new_tokens=40))
    merged = SpeculativeGenerator(target, drafter, tree_budget=8, prompt_lookup=True)
    out["best_first/dflash+lookup"] = _pack(merged.generate(PROMPTS[1] * 2, max_new_tokens=NEW))
    g = SpeculativeGenerator(target, drafter, tree_budget=8, prompt_lookup=False)
    out["sampled/seed"] = _pack(g.generate(PROMPTS[0], max_new_tokens=NEW, temperature=1.0, top_k=20, seed=123))
    return out


class Recording(BudgetPolicy):
    """A budget policy wrapper that keeps what this rank's policy chose on its own, before the broadcast."""

    def __init__(self, policy):
        self.policy, self.local = policy, []

    @property
    def skip_draft(self) -> bool:
        return self.policy.skip_draft

    def prepare(self, context_len, batch):
        self.policy.prepare(context_len, batch)

    def choose(self, proposal, context_len):
        self.local.append(self.policy.choose(proposal, context_len))
        return self.local[-1]

    def observe(self, accepted, verify_seconds, context_len):
        self.policy.observe(accepted, verify_seconds, context_len)


def tp_only(gen: SpeculativeGenerator, rank: int) -> dict:
    """What only a tensor-parallel run can show: rank-dependent clocks and default seeds still give one run."""
    out = {}
    # Ranks that would choose apart: rank 1's rounds seem 50x longer than rank 0's (their verifies not), and it
    # starts from a smaller tree.
    clock = time.perf_counter if rank == 0 else (lambda: 50.0 * time.perf_counter())
    policy = Recording(AutoBudget(builder=gen.builder, candidates=(1, 2, 4, 8, 16), clock=clock,
                                  start=4 if rank == 0 else 1))
    o = gen.generate(PROMPTS[1], max_new_tokens=40, tree_budget=policy)
    out["skewed"] = {**_pack(o), "local": policy.local}
    out["auto"] = _pack(gen.generate(PROMPTS[1], max_new_tokens=40, tree_budget="auto"))
    out["sampled/default_seed"] = _pack(gen.generate(PROMPTS[0], max_new_tokens=NEW, temperature=1.0))
    out["decided"] = gen.lockstep.decide(lambda: 10 * rank + 7)  # run on rank 0 only
    out["shared_tensor"] = gen.lockstep.share(torch.full((2,), float(rank))).tolist()
    return out


def failures(root: Path, gen: SpeculativeGenerator, rank: int) -> dict:
    """One rank's bad input, mismatched drafters: every rank must raise (caught here), none may hang."""
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = None
        except Exception as exc:  # noqa: BLE001 - recorded for the test to read
            out[name] = f"{type(exc).__name__}: {exc}"

    attempt("bad_input", lambda: gen.generate([5, 17, 500] if rank == 1 else [5, 17, 3], max_new_tokens=4))
    attempt("different_prompts", lambda: gen.generate([5, 17, 3 + rank], max_new_tokens=4))
    wrong = root / "wrong_drafter" if rank == 1 else root / "llama" / "drafter"
    attempt("wrong_drafter", lambda: SpeculativeGenerator.from_pretrained(
        str(root / "llama" / "target"), str(wrong), dtype=DTYPE, tp_plan="auto"))
    other = DFlashDraftModel.from_pretrained(root / "llama" / ("other_drafter" if rank == 1 else "drafter"),
                                             dtype=DTYPE)
    attempt("other_weights", lambda: SpeculativeGenerator(gen.target, other, tree_budget=4))
    # Still in step after all that: a normal call works on every rank.
    out["after"] = gen.generate(PROMPTS[0], max_new_tokens=6).row_tokens
    return out


def _thread_names() -> list[str]:
    return sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))


def main() -> int:
    import torch.distributed as dist

    mode, root = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    try:
        if mode == "checks":
            result = {}
            for kind in KINDS:
                gen = load(root, kind, tp_plan="auto")
                result[kind] = {"cases": cases(gen), **tp_only(gen, rank)}
                if kind == "llama":
                    result["failures"] = failures(root, gen, rank)
                    result["sharded_lm_head"] = type(gen.target.get_output_embeddings().weight).__name__
                    llama = gen
            # Every check is written; then the uncaught error ends the run, which must exit every rank (one
            # torchrun instead of a second launch that loads the pair again only to fail).
            (root / f"{mode}_rank{rank}.json").write_text(json.dumps(result))
            llama.generate([5, 17, 500] if rank == 1 else [5, 17, 3], max_new_tokens=4)  # raises on every rank
            result = {"unexpected": "no error"}
        elif mode == "leave":
            # As the data-parallel bench runs: the group, then a load (transformers imports torch.distributed.nn
            # there), a collective, and leaving. No thread of the group may outlive it into the interpreter's exit.
            start_data_parallel("cpu")
            load(root, "llama")
            gather_lists([rank])
            stop_data_parallel()
            result = {"threads_after_leaving": _thread_names()}
        elif mode == "bad-input":
            gen = load(root, "llama", tp_plan="auto")
            gen.generate([5, 17, 500] if rank == 1 else [5, 17, 3], max_new_tokens=4)  # raises on every rank
            result = {"unexpected": "no error"}
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    except Exception as exc:
        print(f"RANK {rank} ERROR {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        if dist.is_initialized():  # both ranks got here: let each print before torchrun stops the other
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
        return 1
    (root / f"{mode}_rank{rank}.json").write_text(json.dumps(result))
    leave_process_group()  # tp_plan made the group; ranks leave it together
    return 0


if __name__ == "__main__":
    sys.exit(main())
