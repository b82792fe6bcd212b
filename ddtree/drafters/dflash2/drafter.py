"""``DFlash2Drafter``: a DFlash2 checkpoint bound to its target (embedding and lm_head borrowed)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, cast

import torch

from ddtree.drafters.dflash.config import read_config_json
from ddtree.drafters.dflash2.config import ARCHITECTURE, DFlash2Config
from ddtree.drafters.dflash2.context import DFlash2Context
from ddtree.drafters.dflash2.model import DFlash2DraftModel
from ddtree.drafters.features import FeatureDrafter, check_target_layer_ids, refuse_other_architecture

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


def check_compatible(config: DFlash2Config, target: PreTrainedModel) -> None:
    """Raise a ValueError naming the mismatch when a DFlash2 drafter cannot serve ``target``."""
    check_compatible_config(config, target.config, vocab_size=target.get_output_embeddings().weight.shape[0])


def check_compatible_config(config: DFlash2Config, target_config: PretrainedConfig,
                            vocab_size: int | None = None) -> None:
    """The same check from the target's config alone (``vocab_size``: its lm_head rows when known), so that a
    wrong pair is refused before either model's weights are downloaded or read."""
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    vocab = vocab_size if vocab_size is not None else tc.vocab_size
    for what, mine, theirs in (("hidden size", config.hidden_size, tc.hidden_size),
                               ("vocab size", config.vocab_size, vocab),
                               ("target decoder layer count", config.num_target_layers, tc.num_hidden_layers)):
        if mine != theirs:
            raise ValueError(f"DFlash2 drafter {what} {mine} does not match the target's {theirs}: "
                             "use a drafter trained for this target")
    check_target_layer_ids(config.target_layer_ids, tc.num_hidden_layers)
    if not 0 <= config.mask_token_id < vocab:
        raise ValueError(f"mask_token_id {config.mask_token_id} is outside the target's vocabulary (size {vocab})")


class DFlash2Drafter(FeatureDrafter):
    """A DFlash2 model bound to its target; each generation gets a :class:`DFlash2Context`.

    Its proposals carry pairwise selector scores: the round grows ``best_first`` trees in which each
    child is ranked given its own parent's token, and ``chain`` is the selector's greedy chain. Proposals
    span the full vocabulary (the selector's top-k needs every logit); single-process targets only.
    """

    model_class = DFlash2DraftModel

    def __init__(self, model: DFlash2DraftModel, target: PreTrainedModel) -> None:
        check_compatible(model.config, target)
        self._bind(model, target)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], target: PreTrainedModel, *, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None,
                        draft_vocab: str | int | torch.Tensor | None = "auto") -> DFlash2Drafter:
        """Bind a published DFlash2 directory to ``target``. ``draft_vocab`` is accepted for a uniform loader
        call, but only as the full vocabulary (``"auto"``, ``None`` or 0): the selector reads every logit."""
        if not (draft_vocab is None or draft_vocab == "auto" or (isinstance(draft_vocab, int) and draft_vocab == 0)):
            raise ValueError("a DFlash2 drafter proposes over the full vocabulary (its selector reads every "
                             "logit): pass draft_vocab='auto' or None")
        file, data = read_config_json(path, "DFlash2")
        refuse_other_architecture(data, ARCHITECTURE, cls.__name__, file)
        check_compatible(DFlash2Config.from_dict(data), target)  # before any weight is read
        dev = device if device is not None else cast(torch.Tensor, target.get_input_embeddings().weight).device
        return cls(DFlash2DraftModel.from_pretrained(path, dtype=dtype, device=dev), target)

    @staticmethod
    def check_config(config_file: str | os.PathLike[str], target_config: PretrainedConfig,
                     vocab_size: int | None = None) -> None:
        """Refuse, from the two configs alone, a drafter that cannot serve the target (before any weight is read)."""
        check_compatible_config(DFlash2Config.from_pretrained(config_file), target_config, vocab_size=vocab_size)

    def new_context(self, batch_size: int = 1) -> DFlash2Context:
        return DFlash2Context(self, batch_size)
