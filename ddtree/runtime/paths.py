"""Where ddtree keeps what it builds or converts once (``$DDTREE_CACHE``, default ``~/.cache/ddtree``)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """ddtree's cache root: ``$DDTREE_CACHE`` or ``~/.cache/ddtree``."""
    env = os.environ.get("DDTREE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ddtree"
