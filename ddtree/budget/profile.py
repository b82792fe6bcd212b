"""A saved round-cost profile: what one machine learned about one model pair, seeding the next run.

:class:`~ddtree.budget.policy.AutoBudget` learns its costs from the rounds; with ``profile=path`` it starts
from the table saved there (if any) and writes the table back when a generation ends, so a later process on
the same machine and model skips the first rounds' measuring. The file is JSON
(:meth:`RoundCosts.to_dict`), written atomically (a temporary file renamed over the old one), and a file
that cannot be read is ignored with a warning naming it (it is rewritten at the next save).
:func:`default_profile` names a file under the ddtree cache folder, one per machine, model pair, device,
dtype and thread count (each changes the costs).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from ddtree.budget.costs import RoundCosts
from ddtree.runtime.paths import cache_dir


def load_profile(path: str | Path) -> RoundCosts | None:
    """The table saved at ``path``; ``None`` when there is none, or (with a warning naming the file) when it
    cannot be read."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        return RoundCosts.load(path)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        warnings.warn(f"ignoring the round-cost profile {path}: {exc}; AutoBudget starts from measured rounds "
                      "and overwrites it when the generation ends", UserWarning, stacklevel=3)
        return None


def save_profile(costs: RoundCosts, path: str | Path) -> None:
    """Write ``costs`` to ``path`` atomically: readers see the old file or the new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(costs.to_dict(), f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def default_profile(generator: Any) -> Path:
    """``<ddtree cache>/budget/<model>-<hash>.json`` for ``generator``'s target and drafter on this machine,
    device, dtype and thread count."""
    target = generator.target
    name = str(getattr(getattr(target, "config", None), "_name_or_path", "") or type(target).__name__)
    drafter = generator.drafter
    drafter_name = str(getattr(getattr(drafter, "config", None), "_name_or_path", "") or type(drafter).__name__)
    weight = target.get_input_embeddings().weight
    parts = [platform.node(), platform.machine(), platform.processor(), name, drafter_name, str(weight.device),
             str(weight.dtype), str(torch.get_num_threads())]
    if weight.device.type == "cuda":
        parts.append(torch.cuda.get_device_name(weight.device))
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(name).name)[:60] or "model"
    return cache_dir() / "budget" / f"{stem}-{digest}.json"
