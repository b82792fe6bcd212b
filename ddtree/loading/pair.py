"""A target and its drafter loaded together, each a local directory or a hub repo id (or neither: the default pair).

Both configs are read first (one small file each), so a wrong pair fails before any weight is downloaded or read,
on every rank of a tensor-parallel load at once.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch

from ddtree.drafters.base import Drafter
from ddtree.loading.drafter import check_drafter_config, load_drafter
from ddtree.loading.hub import config_file, model_dir
from ddtree.runtime.distributed import Lockstep, fail_together


class PretrainedPair(NamedTuple):
    target: Any
    drafter: Drafter
    tokenizer: Any | None  # the target directory's tokenizer, None when it has none


def load_pair(
    target_path_or_id: str | None = None,
    drafter_path_or_id: str | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    draft_vocab: str | int | torch.Tensor | None = "auto",
    tp_plan: str | dict | None = None,
    device_map: str | dict | None = None,
) -> PretrainedPair:
    """Load a target (any HF causal LM), its drafter (the class its ``architectures`` names) and the target's
    tokenizer; the arguments are :meth:`ddtree.SpeculativeGenerator.from_pretrained`'s, which documents them."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if target_path_or_id is None:
        from ddtree.loading.pretrained import default_drafter_dir, smollm2_path

        target_path_or_id = str(smollm2_path())
        drafter_path_or_id = drafter_path_or_id or str(default_drafter_dir())
        dtype = dtype or torch.float32
    if drafter_path_or_id is None:
        raise ValueError("give a drafter directory along with the target (or neither, for the default pair)")
    # A rank failing alone would leave the others in the target's sharded load: ranks that already share a
    # process group fail together.
    with fail_together(f"checking the drafter {drafter_path_or_id} against the target"):
        target_config = AutoConfig.from_pretrained(config_file(target_path_or_id, "target").parent)
        check_drafter_config(drafter_path_or_id, target_config)
        target_dir, drafter_dir = model_dir(target_path_or_id, "target"), model_dir(drafter_path_or_id, "drafter")
    placed = {k: v for k, v in (("tp_plan", tp_plan), ("device_map", device_map)) if v is not None}
    if tp_plan is not None:
        from ddtree.runtime.distributed import before_process_group, check_tp_divides

        check_tp_divides(target_config, int(os.environ.get("WORLD_SIZE", "1")))
        before_process_group()  # transformers makes the group for tp_plan
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype or "auto", **placed)
    if not placed:
        target = target.to(device)  # type: ignore[arg-type]  # transformers wraps Module.to; its stub loses the signature
    with Lockstep.for_model(target).fail_together(f"loading the drafter {drafter_path_or_id}"):
        drafter = load_drafter(drafter_dir, target, device=None if placed else device, draft_vocab=draft_vocab)
    try:
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
    except (OSError, ValueError):
        tokenizer = None
    return PretrainedPair(target, drafter, tokenizer)


def check_target_model(target: Any) -> None:
    """A generator's target is a loaded model: a directory or hub id is refused, naming the loader that takes it
    (only the drafter is loaded from a path by the constructor, since binding it needs the target)."""
    if isinstance(target, (str, os.PathLike)):
        raise TypeError(f"the target is the {type(target).__name__} {os.fspath(target)!r}, not a model: load a "
                        "target and its drafter from directories or hub ids with "
                        "SpeculativeGenerator.from_pretrained(target, drafter), or pass a loaded model (e.g. "
                        "AutoModelForCausalLM.from_pretrained(path)) as the target")
    if not (hasattr(target, "parameters") and hasattr(target, "get_input_embeddings")):
        raise TypeError(f"the target must be a loaded Hugging Face causal LM (a torch module with "
                        f"get_input_embeddings), got {type(target).__name__}; to load one from a directory or hub "
                        "id use SpeculativeGenerator.from_pretrained(target, drafter)")
