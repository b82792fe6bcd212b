"""DFlash checkpoint files: safetensors weights (read header first, nothing unpickled) and the proposal
vocabulary file."""

from __future__ import annotations

import os
from pathlib import Path

import torch

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def weight_files(path: Path) -> list[Path]:
    """The drafter's ``*.safetensors`` files (not the draft-vocabulary sidecar); pickled weights are refused."""
    files = [f for f in sorted(path.glob("*.safetensors")) if f.name != DRAFT_VOCAB_FILE]
    if files:
        return files
    pickled = sorted(f.name for f in path.iterdir() if f.suffix in PICKLED_SUFFIXES) if path.is_dir() else []
    if pickled:
        raise ValueError(
            f"drafter directory {path} holds only pickled weights ({', '.join(pickled)}); ddtree never unpickles "
            "files (a pickle can run arbitrary code). Convert them once, in a process you trust, with "
            "safetensors.torch.save_file(torch.load(f, weights_only=True), 'model.safetensors')"
        )
    raise FileNotFoundError(f"no *.safetensors weights in drafter directory {path}")


def header_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from the safetensors headers, reading no tensor data."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                for k in handle.keys():
                    shapes[k] = tuple(handle.get_slice(k).get_shape())
        except Exception as exc:  # safetensors raises its own error types (SafetensorError, OSError, ...)
            raise ValueError(f"drafter weights {f} cannot be read ({type(exc).__name__}: {exc}): the file is "
                             "truncated or damaged; re-download it") from None
    return shapes


def read_weights(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as exc:
            raise ValueError(f"drafter weights {f} cannot be read ({type(exc).__name__}: {exc}): the file is "
                             "truncated or damaged; re-download it") from None
    return state


def save_draft_vocab(path: str | os.PathLike, token_ids: torch.Tensor) -> None:
    """Write ranked token ids (most useful first) as ``draft_vocab.safetensors`` next to a drafter."""
    from safetensors.torch import save_file

    ids = torch.as_tensor(token_ids).to(torch.int64).flatten().cpu().contiguous()
    save_file({"token_ids": ids}, str(Path(path) / DRAFT_VOCAB_FILE), metadata={"format": "pt"})


def load_draft_vocab(path: str | os.PathLike, vocab_size: int) -> torch.Tensor:
    """Ranked token ids from ``path/draft_vocab.safetensors``, checked against the vocabulary."""
    from safetensors.torch import load_file

    f = Path(path) / DRAFT_VOCAB_FILE
    try:
        ids = load_file(str(f)).get("token_ids")
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"{f} cannot be read ({type(exc).__name__}: {exc}): the file is truncated or damaged; "
                         "re-download it, or delete it to draft over the full vocabulary") from None
    if ids is None:
        raise ValueError(f"{f} has no 'token_ids' tensor; write it with ddtree.drafters.dflash.checkpoint.save_draft_vocab")
    return check_draft_vocab(ids, vocab_size, where=str(f))


def check_draft_vocab(ids: torch.Tensor, vocab_size: int, where: str = "draft_vocab") -> torch.Tensor:
    ids = torch.as_tensor(ids)
    if ids.dim() != 1 or ids.is_floating_point() or ids.numel() == 0:
        raise ValueError(f"{where}: a draft vocabulary is a non-empty 1-D tensor of token ids, got shape "
                         f"{tuple(ids.shape)} and dtype {ids.dtype}")
    ids = ids.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"{where}: token ids must lie in [0, {vocab_size}), got [{int(ids.min())}, {int(ids.max())}]; "
                         "was it built for another tokenizer?")
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"{where}: token ids repeat; a draft vocabulary lists each token once")
    return ids
