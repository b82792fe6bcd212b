"""A drafter from wherever a user has it: a directory, a hub id, a raw drafter model or a bound drafter.

The class comes from the checkpoint's ``architectures`` through :mod:`ddtree.drafters.registry`, so nothing
above this layer names a concrete drafter. A hub id's config is fetched and checked against the target's before
any weight is downloaded (:mod:`ddtree.loading.hub`: the local cache only under ``HF_HUB_OFFLINE``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol, cast

import torch

from ddtree.drafters.base import Drafter, check_drafter
from ddtree.drafters.dflash.config import read_config_json
from ddtree.drafters.lookup import PromptLookup, WithLookup
from ddtree.drafters.registry import drafter_class, drafter_class_for_model
from ddtree.loading.hub import config_file, local_dir, model_dir


class DrafterClass(Protocol):
    """What the loader needs of a registered drafter class: a check from configs alone, then a constructor."""

    def check_config(self, config_file: Path, target_config: Any, vocab_size: int | None = None) -> None: ...

    def from_pretrained(self, path: str | Path, target: Any, **options: Any) -> Drafter: ...


def drafter_class_of(path_or_id: str | os.PathLike) -> tuple[Path, DrafterClass]:
    """The drafter's ``config.json`` (fetched alone for a hub id) and the registered class that loads it."""
    file = config_file(path_or_id, "drafter")
    _, data = read_config_json(file, "DFlash")
    return file, cast(DrafterClass, drafter_class(data, where=f"the drafter config {file}"))


def check_drafter_config(path_or_id: str | os.PathLike, target_config: Any,
                         vocab_size: int | None = None) -> DrafterClass:
    """Refuse, from the configs alone, a drafter that cannot serve the target; returns the drafter's class."""
    file, cls = drafter_class_of(path_or_id)
    cls.check_config(file, target_config, vocab_size=vocab_size)
    return cls


def load_drafter(path_or_id: str | os.PathLike, target: Any, *, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None, **options: Any) -> Drafter:
    """The drafter in a directory or hub repo, bound to ``target`` by the class its ``architectures`` names.

    ``dtype`` defaults to the target's, ``device`` to the target's input embedding's; ``options`` go to the
    class's ``from_pretrained`` (``draft_vocab`` for DFlash). A hub id's config is checked against ``target``
    before its weights are downloaded.
    """
    if isinstance(path_or_id, os.PathLike):
        path_or_id = os.fspath(path_or_id)
    if not isinstance(path_or_id, str):
        raise TypeError(f"load_drafter takes a drafter directory or hub repo id (a str or path), got "
                        f"{type(path_or_id).__name__}")
    directory = local_dir(path_or_id, "drafter")
    if directory is None:  # a hub id: its config alone first, so a wrong pair downloads no weights
        cls = check_drafter_config(path_or_id, target.config,
                                   vocab_size=target.get_output_embeddings().weight.shape[0])
        directory = model_dir(path_or_id, "drafter")
    else:
        cls = drafter_class_of(directory)[1]
    if dtype is None:
        dtype = next(target.parameters()).dtype
    return cls.from_pretrained(directory, target, dtype=dtype, device=device, **options)


def resolve_drafter(drafter: Any, target: Any, prompt_lookup: bool = False) -> Drafter:
    """``drafter`` ready to serve ``target``: a directory or hub id is loaded (:func:`load_drafter`), a raw drafter
    model bound by its registered class, a drafter kept as it is; then checked for every part of the protocol.
    ``prompt_lookup``: merge a prompt-lookup branch into its trees (prompt lookup itself, or a drafter that merges
    it already, is kept: ``prompt_lookup=False`` adds none, it does not take apart a ``WithLookup`` it is given,
    such as another generator's ``gen.drafter``; pass ``gen.drafter.drafter`` for the model drafter alone)."""
    if isinstance(drafter, (str, os.PathLike)):
        drafter = load_drafter(drafter, target)
    else:
        cls = drafter_class_for_model(drafter)
        if cls is not None:
            drafter = cls(drafter, target)
    check_drafter(drafter)
    if prompt_lookup and not isinstance(drafter, (WithLookup, PromptLookup)):
        drafter = WithLookup(drafter, PromptLookup.for_target(target, block_size=drafter.block_size))
    return drafter
