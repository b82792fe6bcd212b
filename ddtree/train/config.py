"""Training configuration: one plain dataclass (nanoGPT style).

Every field can be set from the command line as ``--name value`` (see
``python -m ddtree.train --help``); lists are comma-separated.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class TrainConfig:
    # --- target and output -------------------------------------------------
    target: str = "smollm2"            # "smollm2" (the packaged default) or an HF model directory
    out_dir: str = "runs/drafter"      # checkpoints, log and the exported drafter (out_dir/export)
    data_dir: str = ""                 # feature cache; default: <out_dir>/data (several: comma-separated)
    target_dtype: str = "bfloat16"     # dtype the frozen target runs in for data generation

    # --- data ----------------------------------------------------------------
    source: str = "self-distill"       # "self-distill" (target's own responses) or "text"
    num_prompts: int = 2000            # self-distill: number of generated training prompts
    prompt_offset: int = 0             # self-distill: skip the first N generated prompts (to extend a cache)
    max_new_tokens: int = 256          # self-distill: response length cap
    gen_batch: int = 32                # self-distill: prompts per generation batch
    temperature: float = 0.0           # self-distill: 0 = greedy responses (matches greedy decoding)
    text_paths: list[str] = field(default_factory=list)  # text: files or folders of .py/.txt
    seq_len: int = 512                 # text: window length
    max_text_tokens: int = 500_000     # text: stop after this many tokens
    topk: int = 16                     # teacher top-k log-probs cached per position (soft targets)
    cache_layer_ids: list[int] = field(default_factory=list)  # layers to cache (superset); default = target_layer_ids
    heldout_frac: float = 0.05         # sequences kept out of training for the acceptance estimate
    data_only: bool = False            # build the feature cache and stop
    data_worker: int = 0               # with data_workers > 1: build shards i % data_workers == data_worker; -1: build none
    data_workers: int = 1

    # --- drafter -------------------------------------------------------------
    num_layers: int = 1
    block_size: int = 8                # root + (block_size - 1) predicted slots
    target_layer_ids: list[int] = field(default_factory=list)  # default: the published formula
    mask_token_id: int = -1            # -1: pick an unused special token of the tokenizer
    intermediate_size: int = 0         # 0: the target's
    init_from_target: int = -1         # copy this target decoder layer into every drafter layer (-1: random init)
    draft_vocab: int = 8192            # ship the N most frequent tokens as the drafter's proposal vocabulary (0: all)
    init_from_drafter: str = ""        # warm start: weights of a drafter directory of the same shape (new optimiser)

    # --- optimisation --------------------------------------------------------
    steps: int = 2000
    seqs_per_step: int = 16            # sequences per step (their features are shared by all their blocks)
    anchors_per_seq: int = 32          # random anchor blocks drawn from each sequence's response
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    loss_gamma: float = 3.0            # slot k (1-based) weighs exp(-(k-1)/gamma)
    soft_weight: float = 0.5           # mix of soft (teacher top-k) and hard (actual token) cross-entropy
    vocab_subset: int = 4096           # loss over the N most frequent target tokens (+ the batch's labels); 0 = full vocab
    vocab_negatives: int = 512         # with vocab_subset: random extra tokens per step, to keep the tail suppressed
    autocast: str = "none"             # "bfloat16" or "none"; master weights stay fp32 (bf16 is slow on CPUs without avx512_bf16)
    seed: int = 0
    max_minutes: float = 0.0           # stop (and save) after this wall-clock time; 0 = no limit. The cosine
                                       # schedule then follows whichever budget (steps or minutes) runs out first
    reload_data: bool = True           # at each eval, pick up shards added to the cache since the start

    # --- logging / checkpoints ----------------------------------------------
    log_every: int = 10
    eval_every: int = 200
    eval_blocks: int = 2048            # held-out anchor blocks per evaluation
    save_every: int = 200
    resume: bool = True                # continue from <out_dir>/ckpt.pt when present
    threads: int = 0                   # torch.set_num_threads; 0 = leave as is

    def resolved_data_dir(self) -> str:
        return self.data_dir or f"{self.out_dir.rstrip('/')}/data"


def parse_args(argv=None) -> TrainConfig:
    import argparse
    import typing

    hints = typing.get_type_hints(TrainConfig)
    p = argparse.ArgumentParser(prog="python -m ddtree.train",
                                description="Train a DFlash drafter for a Hugging Face causal LM target.")
    for f in fields(TrainConfig):
        t = hints[f.name]
        default = f.default if f.default is not field else None
        if t is bool:
            p.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=lambda s: s.lower() in ("1", "true", "yes"),
                           default=f.default, metavar="BOOL")
        elif str(t).startswith("list"):
            inner = int if "int" in str(t) else str
            p.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=[],
                           type=lambda s, inner=inner: [inner(x) for x in s.split(",") if x.strip()], metavar="A,B,..")
        else:
            p.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=t, default=default)
    return TrainConfig(**vars(p.parse_args(argv)))
