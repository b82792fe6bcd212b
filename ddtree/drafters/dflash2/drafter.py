"""``DFlash2Drafter``: a DFlash2 checkpoint bound to its target (embedding and lm_head borrowed)."""

from __future__ import annotations

from ddtree.drafters.dflash2.config import DFlash2Config
from ddtree.drafters.dflash2.context import DFlash2Context
from ddtree.drafters.dflash2.model import DFlash2DraftModel
from ddtree.drafters.features import FeatureDrafter, check_target_layer_ids


def check_compatible(config: DFlash2Config, target) -> None:
    """Raise a ValueError naming the mismatch when a DFlash2 drafter cannot serve ``target``."""
    tc = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    vocab = target.get_output_embeddings().weight.shape[0]
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

    def __init__(self, model: DFlash2DraftModel, target):
        check_compatible(model.config, target)
        self._bind(model, target)

    @classmethod
    def from_pretrained(cls, path, target, *, dtype=None, device=None) -> DFlash2Drafter:
        check_compatible(DFlash2Config.from_pretrained(path), target)  # before any weight is read
        dev = device if device is not None else target.get_input_embeddings().weight.device
        return cls(DFlash2DraftModel.from_pretrained(path, dtype=dtype, device=dev), target)

    def new_context(self, batch_size: int = 1) -> DFlash2Context:
        return DFlash2Context(self, batch_size)
