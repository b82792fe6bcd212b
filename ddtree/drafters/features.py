"""Target context features: which target layers feed the drafter, and how to read them.

HF ``output_hidden_states`` returns ``num_layers + 1`` tensors and index 0 is the
embedding output, so target layer ``i`` is ``hidden_states[i + 1]``. Getting this
offset wrong keeps the output correct but collapses acceptance. The round keeps only
the drafter's ``target_layer_ids`` entries (``target_forward(..., layers=)``); the
others are ``None``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ddtree.drafters.base import Drafter

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The published default: the middle layer for one drafter layer, else evenly from 1 to L-3."""
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ValueError(
            f"need at least one target and one drafter layer, got {num_target_layers} and {num_draft_layers}"
        )
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def check_target_layer_ids(layer_ids: Sequence[int], num_target_layers: int) -> list[int]:
    """Validate ids against the target's layer count, with a message that names both."""
    ids = [int(i) for i in layer_ids]
    if not ids:
        raise ValueError("target_layer_ids is empty: the drafter needs at least one target layer")
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(
            f"target_layer_ids {bad} out of range: the target has {num_target_layers} decoder layers "
            f"(valid ids 0..{num_target_layers - 1}); fix dflash_config.target_layer_ids in the drafter config"
        )
    return ids


def extract_context_feature(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int],
                            device: torch.device | str | None = None) -> torch.Tensor:
    """Concatenate target layers ``layer_ids`` (``hidden_states[i + 1]``) on the last dim, on ``device``.

    A layer-split target (``device_map``) returns each layer's hidden states on
    that layer's device; ``device`` (default: the first chosen layer's) gathers them.
    """
    num_layers = len(hidden_states) - 1
    ids = check_target_layer_ids(layer_ids, num_layers)
    device = hidden_states[ids[0] + 1].device if device is None else device
    return torch.cat([hidden_states[i + 1].to(device) for i in ids], dim=-1)


def borrow_target_parts(target: PreTrainedModel) -> tuple:
    """The target's input embedding and lm_head, which a DFlash drafter uses as its own. Borrowed, not owned:
    returned as a tuple, so they are registered nowhere."""
    parts = (target.get_input_embeddings(), target.get_output_embeddings())
    for part, name in zip(parts, ("input embedding", "lm_head")):
        if part.weight.device.type == "meta":
            raise ValueError(f"the target's {name} is offloaded (its weight is on the meta device), and the "
                             f"drafter borrows it: keep it on a device in the device_map (offload layers instead)")
    return parts


class FeatureDrafter(Drafter):
    """What DFlash and DFlash2 drafters share once bound to a target: the model and its settings, the target's
    embedding and lm_head (borrowed, never copied), and the feature read of its ``target_layer_ids``."""

    def _bind(self, model, target) -> None:  # untyped: model is a DFlash or DFlash2 model, read duck-typed
        self.model = model
        self.config = model.config
        self.block_size = model.config.block_size
        self.target_layer_ids = list(model.config.target_layer_ids)
        self.mask_token_id = model.config.mask_token_id
        self._target_parts = borrow_target_parts(target)

    def context_features(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """The target layers' features on the drafter's device (a layer-split target's layers sit on several)."""
        return extract_context_feature(hidden_states, self.target_layer_ids, device=self.model.fc.weight.device)


def refuse_other_architecture(config: dict, architecture: str, class_name: str, where: object) -> None:
    """Refuse a checkpoint whose ``architectures`` name another drafter than ``architecture`` (none named: kept)."""
    names = config.get("architectures") if isinstance(config, dict) else None
    names = [names] if isinstance(names, str) else list(names or [])
    if names and architecture not in names:
        raise ValueError(
            f"{where} is a {', '.join(map(str, names))} checkpoint, which {class_name} does not load (it loads "
            f"{architecture}): load any drafter with ddtree.loading.drafter.load_drafter(path, target), which picks "
            "the class from config.json's architectures (DFlashDraftModel: DFlashDrafter, DFlash2DraftModel: "
            "DFlash2Drafter)")
