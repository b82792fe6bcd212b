"""Training configuration: one plain dataclass (nanoGPT style).

Every field can be set from the command line as ``--name value`` (see
``python -m ddtree.train --help``); lists are comma-separated.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields


@dataclass
class TrainConfig:
    # --- target and output -------------------------------------------------
    target: str = "smollm2"            # "smollm2" (the packaged default) or an HF model directory
    out_dir: str = "runs/drafter"      # checkpoints (ckpt.pt), log.jsonl, and the best drafter exported in the
                                       # published format to out_dir/best
    data_dir: str = ""                 # feature cache; default: <out_dir>/data (several: comma-separated)
    device: str = "auto"               # where the target and the drafter run: "auto" (cuda when available, else
                                       # cpu), "cpu", "cuda", "cuda:N"; under torchrun each rank takes cuda:LOCAL_RANK
    target_dtype: str = "auto"         # dtype of the frozen target (data generation, final acceptance): "auto"
                                       # is float32 on cpu, bfloat16 on cuda

    # --- data ----------------------------------------------------------------
    source: str = "self-distill"       # "self-distill" (target's own responses) or "text"
    num_prompts: int = 2000            # self-distill: number of generated training prompts
    prompt_offset: int = 0             # self-distill: skip the first N generated prompts (to extend a cache)
    prompt_set: str = "templates"      # self-distill: "templates" (training_prompts) or "natural" (natural_prompts)
    max_new_tokens: int = 160          # self-distill: response length cap
    gen_batch: int = 64                # self-distill: prompts per generation batch (one batched decode on the device)
    temperature: float = 0.0           # self-distill: 0 = greedy responses (matches greedy decoding)
    text_paths: list[str] = field(default_factory=list)  # text: files or folders of .py/.txt
    seq_len: int = 512                 # text: window length
    max_text_tokens: int = 500_000     # text: stop after this many tokens
    topk: int = 16                     # teacher top-k log-probs cached per position (soft targets)
    # target layers to cache (a superset of target_layer_ids, its default)
    cache_layer_ids: list[int] = field(default_factory=list)
    heldout_frac: float = 0.05         # sequences kept out of training for the acceptance estimate
    data_only: bool = False            # build the feature cache and stop
    data_worker: int = 0               # with data_workers > 1: build shards i % data_workers == data_worker;
                                       # -1: build none
    data_workers: int = 1              # parallel data builders sharing the cache (see data_worker)

    # --- drafter -------------------------------------------------------------
    num_layers: int = 1                # drafter decoder layers
    block_size: int = 6                # root + (block_size - 1) predicted slots
    num_feature_layers: int = 4        # target layers the drafter reads when target_layer_ids is not given,
                                       # spread by the published formula (never the target's last layer); a
                                       # target under 7 layers gives at most L-1 distinct ones (docs/train.md)
    # target layers whose features feed the drafter (0-based, each once); default: num_feature_layers spread
    # by the published formula
    target_layer_ids: list[int] = field(default_factory=list)
    mask_token_id: int = -1            # -1: pick an unused special token of the tokenizer
    intermediate_size: int = 0         # 0: the target's
    init_from_target: int = -1         # copy this target decoder layer into every drafter layer (-1: random init)
    draft_vocab: int = 8192            # ship the N most frequent tokens as the drafter's proposal vocabulary (0: all)
    init_from_drafter: str = ""        # warm start: weights of a drafter directory of the same shape (new optimiser)

    # --- optimisation --------------------------------------------------------
    steps: int = 2000                  # optimiser steps
    seqs_per_step: int = 8             # sequences per step, all ranks together (their features are shared by
                                       # all their blocks)
    anchors_per_seq: int = 24          # random anchor blocks drawn from each sequence's response
    lr: float = 2e-3                   # peak learning rate (AdamW, cosine schedule); 3e-4 to 5e-4 for a warm start
    min_lr: float = 1e-4               # learning rate at the end of the cosine schedule
    warmup: int = 20                   # linear warm-up steps
    weight_decay: float = 0.01         # AdamW weight decay
    grad_clip: float = 1.0             # gradient norm clip
    loss_gamma: float = 2.5            # slot k (1-based) weighs exp(-(k-1)/gamma)
    soft_weight: float = 0.5           # mix of soft (teacher top-k) and hard (actual token) cross-entropy
    vocab_subset: int = 2048           # loss over the N most frequent target tokens (+ the batch's labels);
                                       # 0 = full vocab
    vocab_negatives: int = 512         # with vocab_subset: random extra tokens per step, to keep the tail suppressed
    autocast: str = "auto"             # "auto" (bfloat16 on a cuda device that supports it, else none),
                                       # "bfloat16" or "none"; master weights stay fp32 (bf16 is slow on CPUs
                                       # without avx512_bf16)
    seed: int = 0                      # seeds prompts, data split, init and sampling
    max_minutes: float = 0.0           # stop (and save) after this wall-clock time; 0 = no limit. The cosine
                                       # schedule then follows whichever budget (steps or minutes) runs out first
    reload_data: bool = True           # at each eval, pick up shards added to the cache since the start

    # --- logging / checkpoints ----------------------------------------------
    log_every: int = 25                # steps between log lines
    eval_every: int = 250              # steps between held-out evaluations (the best one is kept)
    eval_blocks: int = 1536            # held-out anchor blocks per evaluation
    save_every: int = 50               # steps between checkpoints (<out_dir>/ckpt.pt)
    resume: bool = True                # continue from <out_dir>/ckpt.pt when present
    threads: int = 0                   # torch CPU threads; 0 = the tools' thread policy: OMP_NUM_THREADS if set,
                                       # else the physical cores other processes leave free (split between
                                       # torchrun's ranks on one machine), as the demo, chat and bench choose

    # --- acceptance through the inference path (after training) ----------
    accept_prompts: int = 13           # held-out prompts (ddtree/data/prompts.jsonl, never trained on) that
                                       # ddtree's generation runs with the exported drafter; 0: skip
    accept_new_tokens: int = 64        # new tokens per held-out prompt in that run
    accept_tree_budget: int = 4        # draft nodes per round of the tree (best_first) in that run; the chain
                                       # uses block_size - 1
    accept_gap: float = 0.5            # flag a gap when the realised chain's gain (acceptance - 1) is below
                                       # this fraction of the held-out estimate's

    def resolved_data_dir(self) -> str:
        return self.data_dir or f"{self.out_dir.rstrip('/')}/data"

    def resolved_device(self, local_rank: int | None = None) -> str:
        """``device`` with "auto" resolved; a bare "cuda" under torchrun is this rank's GPU."""
        import torch

        dev = self.device
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        if dev == "cuda" and local_rank is not None:
            dev = f"cuda:{local_rank}"
        if dev.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device}: this torch build sees no CUDA device; use --device cpu")
        if dev.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"--device {self.device!r}: use auto, cpu, cuda or cuda:N")
        return dev

    def resolved_target_dtype(self, device: str):
        """The target's torch dtype: "auto" is float32 on the cpu and bfloat16 on cuda."""
        import torch

        name = self.target_dtype
        if name == "auto":
            name = "bfloat16" if device.startswith("cuda") else "float32"
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"--target-dtype {self.target_dtype!r}: use auto, float32, bfloat16 or float16")
        return dtype

    def use_autocast(self, device: str) -> bool:
        """bf16 autocast for training: "auto" turns it on on a cuda device with bf16 support only."""
        import torch

        if self.autocast not in ("auto", "bfloat16", "none"):
            raise ValueError(f"--autocast {self.autocast!r}: use auto, bfloat16 or none")
        if self.autocast == "auto":
            return device.startswith("cuda") and torch.cuda.is_bf16_supported()
        return self.autocast == "bfloat16"


EXAMPLES = [
    "python -m ddtree.train --target smollm2 --out-dir runs/smoke --num-prompts 16 --max-new-tokens 32 "
    "--gen-batch 16 --steps 20 --warmup 5 --eval-every 10 --eval-blocks 128 --heldout-frac 0.25 "
    "--accept-prompts 2 --accept-new-tokens 16",
    "python -m ddtree.train --target smollm2 --out-dir runs/smollm2 --num-prompts 2000 --steps 3000",
    "python -m ddtree.train --target smollm2 --out-dir runs/smollm2-data --num-prompts 200 --data-only true",
]


def field_help() -> dict[str, str]:
    """Each field's help: the comment after it in this file (continued on comment-only lines below it)."""
    import inspect
    import io
    import tokenize

    try:
        source = inspect.getsource(TrainConfig)
    except (OSError, TypeError):
        return {}
    helps: dict[str, str] = {}
    current = None
    line_of_field = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and tok.start[1] == 4 and tok.string in TrainConfig.__dataclass_fields__:
            current = tok.string
            line_of_field[current] = tok.start[0]
        elif tok.type == tokenize.COMMENT and current is not None:
            text = tok.string.lstrip("#").strip()
            if tok.start[0] == line_of_field[current] or (tok.start[1] > 4 and current in helps):
                helps[current] = f"{helps[current]} {text}".strip() if current in helps else text
        elif tok.type == tokenize.NAME and tok.start[1] == 4:
            current = None
    return helps


def build_parser():
    """The ``python -m ddtree.train`` parser: one option per :class:`TrainConfig` field."""
    import typing

    from ddtree.apps.cli import parser

    hints = typing.get_type_hints(TrainConfig)
    helps = field_help()
    p = parser("python -m ddtree.train", "Train a DFlash drafter for a Hugging Face causal LM target: build (or "
               "reuse) the feature cache, then train and export. Lists are comma-separated; booleans take "
               "true/false.", EXAMPLES)
    for f in fields(TrainConfig):
        t = hints[f.name]
        default = f.default if f.default is not MISSING else f.default_factory()
        flag = f"--{f.name.replace('_', '-')}"
        text = helps.get(f.name, f.name.replace("_", " ")).replace("%", "%%")
        if t is bool:
            p.add_argument(flag, dest=f.name, type=lambda s: s.lower() in ("1", "true", "yes"),
                           default=default, metavar="BOOL", help=text)
        elif str(t).startswith("list"):
            inner = int if "int" in str(t) else str
            p.add_argument(flag, dest=f.name, default=default, metavar="A,B,..", help=text,
                           type=lambda s, inner=inner: [inner(x) for x in s.split(",") if x.strip()])
        else:
            p.add_argument(flag, dest=f.name, type=t, default=default, help=text)
    return p


def parse_args(argv=None) -> TrainConfig:
    """The run's config; a layer flag that no target could take is refused here, before anything loads."""
    from ddtree.train.layers import check_layer_flags

    p = build_parser()
    cfg = TrainConfig(**vars(p.parse_args(argv)))
    try:
        check_layer_flags(cfg.num_feature_layers, cfg.target_layer_ids, cfg.cache_layer_ids)
    except ValueError as e:
        p.error(str(e))
    return cfg
