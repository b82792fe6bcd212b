"""Local directories or Hugging Face hub ids, for the target and the drafter of ``from_pretrained``.

A name that exists on disk is a directory. A name that looks like a path (absolute, ``./``, ``~``, or more
than one ``/``) and does not exist is refused as a missing directory, by name. Anything else (``name`` or
``owner/name``) is a hub repo id, looked up in the local hub cache first and downloaded only when the hub
may be used (``HF_HUB_OFFLINE`` unset): the errors say what to do when it cannot be. ``config_file`` fetches
one config, so a pair can be checked before any weight is downloaded or read.
"""

from __future__ import annotations

import os
from pathlib import Path

_OFFLINE_VALUES = ("1", "true", "yes", "on")


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` (or transformers' ``TRANSFORMERS_OFFLINE``) says not to use the network."""
    return any(os.environ.get(v, "").strip().lower() in _OFFLINE_VALUES for v in ("HF_HUB_OFFLINE",
                                                                                   "TRANSFORMERS_OFFLINE"))


def looks_like_path(name: str) -> bool:
    """A name only a file system would give: absolute, relative to ``.``/``~``, or with more than one ``/``."""
    return (os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 or "\\" in name
            or name.endswith("/"))


def local_dir(name: str | os.PathLike, role: str = "model") -> Path | None:
    """``name`` as an existing local directory, ``None`` for a hub repo id; a missing or file path is refused."""
    path = Path(os.path.expanduser(str(name)))
    if path.is_dir():
        return path
    if path.exists():
        raise NotADirectoryError(f"the {role} {path} is a file, not a model directory: pass the directory that "
                                 "holds its config.json")
    if not isinstance(name, str) or looks_like_path(name):
        raise FileNotFoundError(f"the {role} directory {path} does not exist: check the path (or pass a hub "
                                "repo id such as 'owner/name')")
    return None


def _hub_error(repo_id: str, role: str, what: str, exc: Exception) -> OSError:
    if hub_offline():
        how = ("HF_HUB_OFFLINE is set, so only the local hub cache is used and it does not hold it: download it "
               f"where the hub is reachable (`hf download {repo_id}`, into this HF_HOME cache), or pass a local "
               "directory")
    else:
        how = (f"the hub could not be reached or has no such repo ({type(exc).__name__}: {str(exc)[:200]}): "
               f"check the id, download it where the hub is reachable (`hf download {repo_id}`), or pass a "
               "local directory")
    return OSError(f"the {role} {repo_id!r} is not a local directory, and its {what} is not available: {how}")


def config_file(name: str | os.PathLike, role: str = "model") -> Path:
    """The ``config.json`` of a local directory or a hub repo (only that file is fetched)."""
    local = local_dir(name, role)
    if local is not None:
        return local / "config.json"
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(str(name), "config.json", local_files_only=hub_offline()))
    except Exception as exc:  # offline, unreachable, unknown repo, gated: one message that says what to do
        raise _hub_error(str(name), role, "config.json", exc) from None


def model_dir(name: str | os.PathLike, role: str = "model") -> Path:
    """A local directory, or a hub repo's snapshot directory (from the cache, downloaded when allowed)."""
    local = local_dir(name, role)
    if local is not None:
        return local
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(name), local_files_only=hub_offline()))
    except Exception as exc:
        raise _hub_error(str(name), role, "files", exc) from None
