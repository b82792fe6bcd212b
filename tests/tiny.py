"""The tests' one set of tiny models: random targets of every family, a DFlash drafter for them, a word-level
tokenizer, ``ScriptedDrafter``, whose proposals follow a known continuation (so acceptance is predictable), and
``OracleDrafter``, a perfect drafter at the target's own confidence.

Import from here; ``conftest.py`` builds its fixtures from these and is never imported.
"""

from __future__ import annotations

import math

import pytest
import torch

from ddtree import DraftContext, Drafter, Proposal
from ddtree.blocks import DFlashConfig, DFlashDraftModel

VOCAB = 97
MASK_ID = 96
WINDOW = 8  # every sliding window of the family targets; prompts in the family tests are longer

_BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)

FAMILIES = {
    # name: (model_type, config overrides, what it exercises)
    "llama": ("llama", {}, "full attention"),
    "mistral": ("mistral", dict(sliding_window=WINDOW), "config-level sliding_window, no layer_types"),
    "mixtral": ("mixtral", dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
                "config-level window + MoE"),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
              "use_sliding_window / max_window_layers"),
    "qwen3_moe": ("qwen3_moe", dict(_MOE), "MoE"),
    "gemma2": ("gemma2", dict(sliding_window=WINDOW, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
               "alternating windows + logit softcapping"),
    "gemma3": ("gemma3_text", dict(sliding_window=WINDOW), "alternating windows"),
    "cohere2": ("cohere2", dict(sliding_window=WINDOW), "3 sliding : 1 full"),
    "gpt_oss": ("gpt_oss", dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
                "attention sinks + alternating windows + MoE (eager only)"),
    "qwen3_5": ("qwen3_5_text", dict(_GDN), "GDN hybrid (3 GDN : 1 attention)"),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(_GDN, **_MOE, shared_expert_intermediate_size=32), "GDN hybrid + MoE"),
    "qwen3_next": ("qwen3_next", dict(_GDN, **_MOE, shared_expert_intermediate_size=32), "GDN hybrid + MoE"),
}
HYBRIDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def tiny_config(kind: str = "qwen3", vocab: int = VOCAB, **overrides):
    """The config of a tiny ``"qwen3"`` or ``"llama"`` target (hidden 64, 4 layers)."""
    from transformers import LlamaConfig, Qwen3Config

    common = dict(_BASE, vocab_size=vocab)
    common.update(overrides)
    if kind == "qwen3":
        return Qwen3Config(**common)
    if kind == "llama":
        common.pop("head_dim")
        return LlamaConfig(**common)
    raise ValueError(f"tiny_config makes 'qwen3' or 'llama'; for {kind!r} use tiny_target({kind!r})")


def tiny_target(kind: str = "qwen3", seed: int = 0, dtype=torch.float64, vocab: int = VOCAB, sharpen: bool = True,
                **overrides):
    """A tiny random target: ``"qwen3"``, ``"llama"``, or any name in ``FAMILIES`` (skipped where this
    transformers lacks it). ``sharpen`` scales the lm_head so greedy continuations are not degenerate."""
    if kind in ("qwen3", "llama"):
        from transformers import LlamaForCausalLM, Qwen3ForCausalLM

        torch.manual_seed(seed)
        cls = Qwen3ForCausalLM if kind == "qwen3" else LlamaForCausalLM
        model = cls(tiny_config(kind, vocab, **overrides))
        if sharpen:
            with torch.no_grad():
                model.lm_head.weight.mul_(4.0)
        return model.to(dtype).eval()
    return _family_target(kind, seed, dtype, vocab, sharpen, **overrides)


def _family_target(name: str, seed: int, dtype, vocab: int, sharpen: bool, **extra):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    model_type, overrides, _ = FAMILIES[name]
    if model_type not in CONFIG_MAPPING:
        import transformers

        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r} model type")
    torch.manual_seed(seed)
    config = CONFIG_MAPPING[model_type](**dict(_BASE, vocab_size=vocab), **overrides, **extra)
    model = AutoModelForCausalLM.from_config(config)
    if any("experts" in n for n, _ in model.named_modules()):
        model.set_experts_implementation("eager")  # the grouped-mm experts path takes no float64
    with torch.no_grad():
        if sharpen:
            model.lm_head.weight.mul_(4.0)
        for pname, param in model.named_parameters():
            if "linear_attn.out_proj" in pname:
                param.mul_(8.0)  # let the GDN state matter to the logits, so a mis-forked state shows
    model.generation_config.eos_token_id = None  # the tests compare fixed-length greedy runs
    return model.to(dtype).eval()


def family_target(name: str, seed: int = 0, dtype=torch.float64, vocab: int = VOCAB):
    """The tiny target of family ``name`` (the family tests' spelling of ``tiny_target``)."""
    return _family_target(name, seed, dtype, vocab, True)


def tiny_drafter(target, seed: int = 1, block_size: int = 5, num_layers: int = 2, dtype=None, **cfg_overrides):
    """A random DFlash drafter for ``target`` (a model, or a config: then float64), in the target's dtype."""
    config = getattr(target, "config", target)
    if dtype is None:
        dtype = next(target.parameters()).dtype if hasattr(target, "parameters") else torch.float64
    cfg_overrides.setdefault("num_hidden_layers", num_layers)
    cfg_overrides.setdefault("mask_token_id", MASK_ID)
    torch.manual_seed(seed)
    cfg = DFlashConfig.for_target(config, block_size=block_size, **cfg_overrides)
    return DFlashDraftModel(cfg).to(dtype).eval()


def tiny_tokenizer():
    """A word-level tokenizer over the tiny vocabulary: ids 3..95 are the words ``w3``..``w95``.

    ``<eos>`` is 1, ``<pad>`` 2 and ``<mask>`` 96; the chat template joins turns as
    ``role: text <eos>``, so no network or model download is needed.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, "<pad>": 2, **{f"w{i}": i for i in range(3, VOCAB - 1)}, "<mask>": MASK_ID}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>", pad_token="<pad>")
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }} <eos> {% endfor %}{% if add_generation_prompt %}w3 {% endif %}"
    )
    return tok


SLOW_FACTOR = 1
"""Set by ``conftest.py``: 20 under ``--slow``."""


def examples(n: int) -> int:
    """The example count for a property test: ``n`` in CI, ``20 * n`` with ``--slow``."""
    return n * SLOW_FACTOR


class ScriptedDrafter(Drafter):
    """A drafter whose proposals come from a known continuation (by absolute position).

    ``reference`` is the full token sequence the target will produce (or one per
    row of a batch: a list). At context length ``c`` (the root sits at ``c``)
    slot ``k`` proposes ``reference[c + k]`` with probability ``1 - eps``;
    ``decoy_at`` maps a depth (1-based) to a wrong token that gets the top rank
    there instead, pushing the right one to rank 1. Every proposal is logged in
    ``proposals``; the drafter keeps no per-generation state of its own.
    With ``match_prompt`` a row follows the reference that starts with its prompt
    (for callers that run prompts one by one, like the bench), not the one at its row index.
    """

    def __init__(self, reference, vocab: int, block_size: int = 5, decoy_at: dict | None = None,
                 match_prompt: bool = False):
        self.match_prompt = match_prompt
        refs = reference if isinstance(reference, (list, tuple)) else [reference]
        self.references = [torch.as_tensor(r).view(-1) for r in refs]
        self.vocab = vocab
        self.block_size = block_size
        self.target_layer_ids = [0]
        self.decoy_at = decoy_at or {}
        self.proposals: list[torch.Tensor] = []

    @property
    def reference(self) -> torch.Tensor:
        return self.references[0]

    def context_features(self, hidden_states):
        return hidden_states[1]  # target layer 0, the one it declares

    def new_context(self, batch_size: int = 1):
        return _ScriptedContext(self, batch_size)


class _ScriptedContext(DraftContext):
    def __init__(self, drafter: ScriptedDrafter, batch_size: int):
        self.drafter = drafter
        self.rows = list(range(batch_size))  # which reference each active row follows
        self.lengths = [0] * batch_size

    def append(self, features, tokens, counts=None, host_counts=None):
        t = tokens.shape[1]
        counts = [t] * len(self.rows) if counts is None else host_counts or [int(c) for c in counts]
        if self.drafter.match_prompt and not any(self.lengths):  # the prefill: each row's prompt, left-aligned
            refs = self.drafter.references
            self.rows = [next(j for j, r in enumerate(refs) if r[:c].tolist() == tokens[i, :c].tolist())
                         for i, c in enumerate(counts)]
        self.lengths = [n + c for n, c in zip(self.lengths, counts)]

    def select_rows(self, rows):
        keep = [int(r) for r in rows]
        self.rows = [self.rows[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]

    def propose(self, root_tokens):
        d = self.drafter
        depth = d.block_size - 1
        logits = torch.full((len(self.rows), depth, d.vocab), -30.0)
        for i, (row, length) in enumerate(zip(self.rows, self.lengths)):
            reference = d.references[min(row, len(d.references) - 1)]
            for k in range(1, depth + 1):
                pos = length + k
                if pos >= reference.numel():
                    continue
                right = int(reference[pos])
                logits[i, k - 1, right] = 10.0
                if k in d.decoy_at:
                    wrong = (right + 1 + d.decoy_at[k]) % d.vocab
                    logits[i, k - 1, wrong] = 12.0
        lp = logits.log_softmax(-1).to(root_tokens.device)
        d.proposals.append(lp)
        return Proposal(lp)


class OracleDrafter(Drafter):
    """A perfect drafter: at each depth it proposes the target's own next-token distribution along the target's
    greedy continuation of ``prompt``, so its best guess at every depth is the token greedy decoding emits, at
    the target's own confidence (often well below 1 on a tiny random target). ``reference`` holds the prompt
    and ``new`` greedy tokens after it; past its end the proposal is uniform."""

    def __init__(self, target, prompt, new: int, block_size: int = 6):
        ids = torch.tensor([list(prompt)])
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                              pad_token_id=0)
        self.reference = out[0]
        with torch.no_grad():
            logits = target(self.reference[None]).logits[0].double()
        self.logprobs = logits.log_softmax(-1)  # [T, V]: row p is the distribution of the token at p + 1
        self.vocab = logits.shape[-1]
        self.block_size = block_size
        self.target_layer_ids = [0]
        self.proposals = 0

    def context_features(self, hidden_states):
        return hidden_states[1]

    def new_context(self, batch_size: int = 1):
        return _OracleContext(self)

    def proposal_at(self, length: int) -> torch.Tensor:
        """``[1, block_size - 1, V]``: the log-probs proposed when ``length`` tokens are committed (the root at
        position ``length``)."""
        depth = self.block_size - 1
        lp = torch.full((1, depth, self.vocab), -math.log(self.vocab), dtype=torch.float64)
        for k in range(1, depth + 1):
            row = length + k - 1  # its logits predict the token at length + k
            if row < self.logprobs.shape[0]:
                lp[0, k - 1] = self.logprobs[row]
        return lp


class _OracleContext(DraftContext):
    def __init__(self, drafter: OracleDrafter):
        self.drafter, self.length = drafter, 0

    def append(self, features, tokens, counts=None, host_counts=None):
        self.length += tokens.shape[1] if counts is None else (host_counts or [int(counts[0])])[0]

    def select_rows(self, rows):
        pass

    def propose(self, root_tokens):
        self.drafter.proposals += 1
        return Proposal(self.drafter.proposal_at(self.length).to(root_tokens.device))
