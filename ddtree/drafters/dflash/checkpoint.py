"""DFlash checkpoint files: safetensors weights (read header first, nothing unpickled) and the proposal
vocabulary file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

# The proposal vocabulary, as JSON: not a ``*.safetensors`` file, because other loaders (vLLM) read every
# ``*.safetensors`` in a drafter directory as weights.
DRAFT_VOCAB_FILE = "ddtree_draft_vocab.json"
LEGACY_DRAFT_VOCAB_FILE = "draft_vocab.safetensors"  # what ddtree wrote before; still read


PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def weight_files(path: Path) -> list[Path]:
    """The drafter's ``*.safetensors`` files (not the draft-vocabulary sidecar); pickled weights are refused."""
    files = [f for f in sorted(path.glob("*.safetensors")) if f.name != LEGACY_DRAFT_VOCAB_FILE]
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


def check_header_shapes(shapes: dict, own: dict, path: str | os.PathLike[str], kind: str = "drafter") -> None:
    """The checkpoint's tensor names and shapes (from its headers) against those its config implies."""
    missing, unexpected = sorted(set(own) - set(shapes)), sorted(set(shapes) - set(own))
    if missing or unexpected:
        raise ValueError(f"{kind} weights in {path} do not match its config: missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}")
    for k, shape in shapes.items():
        if shape != own[k]:
            raise ValueError(f"{kind} weight {k} has shape {shape}, config implies {own[k]}: config.json and the "
                             "weights belong to different drafters; re-download the directory")


def check_finite(state: dict, kind: str = "drafter") -> None:
    """Refuse weights that hold NaN or inf (a damaged file, or a run that diverged before it was saved)."""
    for k, v in state.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            bad = int((~torch.isfinite(v)).sum())
            raise ValueError(f"{kind} weight {k} holds {bad} NaN or inf values: the checkpoint is damaged "
                             "(or was saved from a diverged run); re-download or retrain it")


def refuse_pickled_sidecars(path: Path) -> None:
    """A pickled ``mask_embedding.pt`` (vLLM's sidecar) is refused by name: ddtree never unpickles."""
    found = sorted(f.name for f in path.glob("mask_embedding.*") if f.suffix in PICKLED_SUFFIXES) if path.is_dir() \
        else []
    if found:
        raise ValueError(
            f"drafter directory {path} has {found[0]}, a pickled mask embedding; ddtree never unpickles files (a "
            "pickle can run arbitrary code), and ignoring it would change the drafts. Convert it once, in a process "
            "you trust: add torch.load(f, weights_only=True) (the tensor, or its 'embedding' entry, flattened) to "
            "model.safetensors under the name 'mask_embedding', then delete the .pt file")


def draft_vocab_file(path: str | os.PathLike) -> Path | None:
    """The proposal vocabulary file of a drafter directory (the current name, else the legacy one), or None."""
    for name in (DRAFT_VOCAB_FILE, LEGACY_DRAFT_VOCAB_FILE):
        f = Path(path) / name
        if f.exists():
            return f
    return None


def save_draft_vocab(path: str | os.PathLike, token_ids: torch.Tensor) -> None:
    """Write ranked token ids (most useful first) as ``ddtree_draft_vocab.json`` next to a drafter."""
    ids = torch.as_tensor(token_ids).to(torch.int64).flatten().cpu().tolist()
    (Path(path) / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": ids}) + "\n")
    legacy = Path(path) / LEGACY_DRAFT_VOCAB_FILE
    if legacy.exists():  # one vocabulary per directory, and none where vLLM reads weights
        legacy.unlink()


def load_draft_vocab(path: str | os.PathLike, vocab_size: int) -> torch.Tensor:
    """Ranked token ids from the directory's vocabulary file (JSON, or the legacy safetensors), checked."""
    f = draft_vocab_file(path)
    if f is None:
        raise FileNotFoundError(f"no {DRAFT_VOCAB_FILE} in {path}")
    try:
        if f.name == DRAFT_VOCAB_FILE:
            data = json.loads(f.read_text())
            ids = data.get("token_ids") if isinstance(data, dict) else None
            if ids is not None and not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                                                        for i in ids)):
                raise ValueError("token_ids is not a list of ints")
            ids = None if ids is None else torch.tensor(ids, dtype=torch.int64)
        else:
            from safetensors.torch import load_file

            ids = load_file(str(f)).get("token_ids")
    except Exception as exc:  # safetensors and json raise their own error types
        raise ValueError(f"{f} cannot be read ({type(exc).__name__}: {exc}): the file is truncated or damaged; "
                         "re-download it, or delete it to draft over the full vocabulary") from None
    if ids is None:
        raise ValueError(f"{f} has no 'token_ids'; write it with ddtree.drafters.dflash.checkpoint.save_draft_vocab")
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
