"""``DFlashDrafter``: a DFlash checkpoint bound to its target (embedding, lm_head, proposal vocabulary)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, cast

import torch

from ddtree.core.sampling import log_softmax_inplace
from ddtree.drafters.dflash.checkpoint import DRAFT_VOCAB_FILE, check_draft_vocab
from ddtree.drafters.dflash.config import DFlashConfig, read_config_json
from ddtree.drafters.dflash.context import DFlashContext
from ddtree.drafters.dflash.model import DFlashDraftModel
from ddtree.drafters.features import FeatureDrafter, check_target_layer_ids, refuse_other_architecture
from ddtree.runtime.distributed import Lockstep, full_tensor, module_fingerprint
from ddtree.targets import cpu_linear

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

ARCHITECTURE = "DFlashDraftModel"


def target_vocab_size(target: PreTrainedModel) -> int:
    head = target.get_output_embeddings()
    return head.weight.shape[0]


def check_compatible(config: DFlashConfig, target: PreTrainedModel) -> None:
    """Raise a ValueError naming the mismatch when a drafter cannot serve ``target`` (a model)."""
    check_compatible_config(config, target.config, vocab_size=target_vocab_size(target))


def check_compatible_config(config: DFlashConfig, target_config: PretrainedConfig,
                            vocab_size: int | None = None) -> None:
    """The same check from the target's config alone (``vocab_size``: its lm_head rows when known), so that a
    wrong pair is refused before either model's weights are downloaded or read."""
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    want = config.target_hidden_size or config.hidden_size
    if tc.hidden_size != want:
        field = "target_hidden_size" if config.target_hidden_size else "hidden size"
        raise ValueError(
            f"drafter {field} {want} does not match the target's {tc.hidden_size}: "
            "use a drafter trained for this target"
        )
    vocab: int = vocab_size if vocab_size is not None else tc.vocab_size
    if vocab != config.vocab_size:
        raise ValueError(
            f"drafter vocab size {config.vocab_size} does not match the target's lm_head ({vocab}): "
            "use a drafter trained for this target's tokenizer"
        )
    check_target_layer_ids(config.target_layer_ids, tc.num_hidden_layers)
    if config.num_target_layers != tc.num_hidden_layers:
        raise ValueError(
            f"the drafter was trained for a target with {config.num_target_layers} decoder layers, this target "
            f"has {tc.num_hidden_layers}: use a drafter trained for this target"
        )
    if config.mask_token_id is None or not 0 <= config.mask_token_id < vocab:
        raise ValueError(f"mask_token_id {config.mask_token_id} is outside the target's vocabulary (size {vocab})")


class DraftLinears(torch.nn.Module):
    """A draft step's linears, which the generator routes through the CPU kernel with the target's (a draft is
    a few-row forward too): the draft model's and the LM head over a draft vocabulary (a slice of the
    target's head, the drafter's own copy; ``None`` for the full vocabulary, the target's routed module)."""

    def __init__(self, model: DFlashDraftModel) -> None:
        super().__init__()
        self.model = model
        self.head: torch.nn.Linear | None = None


class DFlashDrafter(FeatureDrafter):
    """A DFlash model bound to its target: weights and settings only, shared by every generation.

    Per generation, :meth:`new_context` gives a :class:`DFlashContext`: each round
    ``ctx.propose(roots)`` for the block after each row's committed context, then
    ``ctx.append(features, tokens, counts)`` for the tokens the target accepted.
    """

    model_class = DFlashDraftModel

    def __init__(self, model: DFlashDraftModel, target: PreTrainedModel,
                 draft_vocab: str | int | torch.Tensor | None = "auto") -> None:
        self._lockstep = Lockstep.for_model(target)  # a tensor-parallel target's ranks bind together
        with self._lockstep.fail_together("binding the drafter to the target"):
            check_compatible(model.config, target)
        self._bind(model, target)
        self.cpu_linear_model = DraftLinears(model)
        self.set_draft_vocab(draft_vocab)

    def set_draft_vocab(self, draft_vocab: str | int | torch.Tensor | None = "auto") -> None:
        """Restrict proposals to a token subset, so the drafter's lm_head reads a slice of the target's.

        On a CPU the full-vocabulary head over the block costs more than the
        drafter's layers; a ranked subset of the most frequent tokens keeps the
        proposals that can realistically be accepted. Outside the subset the
        log-probs are ``-inf``. Verification is unchanged, so output stays exact.

        ``"auto"``: the model's ``draft_vocab`` if it has one, else the full vocabulary;
        ``None`` or ``0``: the full vocabulary; an int ``n``: the model's ``n`` top-ranked ids;
        a tensor: these ids.
        """
        with self._lockstep.fail_together("choosing the draft vocabulary"):
            ids = self._draft_vocab_ids(draft_vocab)
        if self._lockstep.active:  # gathering a sharded lm_head below is a collective: same branch everywhere
            self._lockstep.agree((module_fingerprint(self.model), None if ids is None else ids.tolist()),
                                 "the drafter")
        self._slice_head(ids)

    def _draft_vocab_ids(self, draft_vocab: str | int | torch.Tensor | None) -> torch.Tensor | None:
        """The token ids ``draft_vocab`` names (checked), or ``None`` for the full vocabulary."""
        vocab = self._target_parts[1].weight.shape[0]
        ranked = self.model.draft_vocab
        if isinstance(draft_vocab, str):
            if draft_vocab != "auto":
                raise ValueError(f"draft_vocab must be 'auto', None, an int or a tensor of token ids, "
                                 f"got {draft_vocab!r}")
            ids = ranked
        elif draft_vocab is None or (isinstance(draft_vocab, int) and draft_vocab == 0):
            ids = None
        elif isinstance(draft_vocab, int):
            if ranked is None:
                raise ValueError(f"draft_vocab={draft_vocab} needs a ranked vocabulary, and this drafter has no "
                                 f"{DRAFT_VOCAB_FILE}; pass the token ids as a tensor instead")
            if draft_vocab < 0:
                raise ValueError(f"draft_vocab must be >= 0 (0 = full vocabulary), got {draft_vocab}")
            ids = ranked[:draft_vocab]
        else:
            ids = check_draft_vocab(draft_vocab, vocab)
        if ids is not None and ids.numel() >= vocab:
            ids = None
        return ids

    def _slice_head(self, ids: torch.Tensor | None) -> None:
        head = self._target_parts[1]
        linears = cast(DraftLinears, self.cpu_linear_model)
        if ids is None:
            self.draft_vocab, linears.head = None, None
            return
        # The slice is the drafter's own copy, on its device: a tensor-parallel lm_head is gathered whole
        # first (every rank runs this), a layer-split one may sit on another device than the drafter.
        device = self.model.fc.weight.device
        weight, bias = full_tensor(head.weight.detach()), getattr(head, "bias", None)
        bias = None if bias is None else full_tensor(bias.detach())
        ids = ids.to(device).sort().values
        sliced = torch.nn.Linear(weight.shape[1], ids.numel(), bias=bias is not None, device="meta")
        sliced.weight = torch.nn.Parameter(weight.to(device)[ids].contiguous(), requires_grad=False)
        if bias is not None:
            sliced.bias = torch.nn.Parameter(bias.to(device)[ids].contiguous(), requires_grad=False)
        cpu_linear.route_like(sliced, self.model.fc)  # a vocabulary chosen after the generator routed the model
        self.draft_vocab, linears.head = ids, sliced

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], target: PreTrainedModel, *, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None,
                        draft_vocab: str | int | torch.Tensor | None = "auto") -> DFlashDrafter:
        """Bind a published DFlash drafter directory to ``target`` (``dtype``: the file's unless given; ``device``:
        the target's input embedding's). A checkpoint of another architecture is refused: load any drafter with
        :func:`ddtree.loading.drafter.load_drafter`, which picks the class from ``architectures``."""
        file, data = read_config_json(path, "DFlash")
        refuse_other_architecture(data, ARCHITECTURE, cls.__name__, file)
        cls.check_config(file, target.config, vocab_size=target_vocab_size(target))  # before any weight is read
        dev = device if device is not None else cast(torch.Tensor, target.get_input_embeddings().weight).device
        return cls(DFlashDraftModel.from_pretrained(path, dtype=dtype, device=dev), target, draft_vocab=draft_vocab)

    @staticmethod
    def check_config(config_file: str | os.PathLike[str], target_config: PretrainedConfig,
                     vocab_size: int | None = None) -> None:
        """Refuse, from the two configs alone, a drafter that cannot serve the target (before any weight is read)."""
        check_compatible_config(DFlashConfig.from_pretrained(config_file), target_config, vocab_size=vocab_size)

    def new_context(self, batch_size: int = 1) -> DFlashContext:
        return DFlashContext(self, batch_size)

    def block_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Log-probs over the target's vocabulary (``-inf`` outside a draft vocabulary), float32."""
        lm_head = self._target_parts[1]
        lead = hidden.shape[:-1]
        # rows, not a [B, depth] slice of the block: on a CPU, a 3-D input whose rows are strided sends torch's
        # matmul down its batched path, which copies the whole head weight on every call
        hidden = hidden.to(lm_head.weight.dtype).reshape(-1, hidden.shape[-1])
        sliced, ids = cast(DraftLinears, self.cpu_linear_model).head, self.draft_vocab  # set together
        if sliced is None or ids is None:  # the target's own module: its tensor-parallel or device hooks apply
            logits = self.model.process_logits(lm_head(hidden.to(lm_head.weight.device)).float())
            return log_softmax_inplace(logits.contiguous()).to(hidden.device).view(*lead, -1)
        sub = log_softmax_inplace(self.model.process_logits(sliced(hidden).float()).contiguous())
        out = sub.new_full((*sub.shape[:-1], lm_head.weight.shape[0]), float("-inf"))
        return out.index_copy_(-1, ids, sub).view(*lead, -1)
