"""The row-invariant C kernels (``csrc/row_invariant.c``), built once with the system compiler and loaded.

The library is compiled on first use (AVX2 + FMA + F16C, OpenMP) into the ddtree cache directory, named by a
hash of its source and flags, and loaded with ctypes. Where it cannot be (another CPU, no compiler, an
unwritable cache) :func:`library` says why, and the callers fall back or refuse with that reason.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

SOURCE = Path(__file__).with_name("csrc") / "row_invariant.c"
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
NEEDED_FLAGS = {"avx2", "fma", "f16c"}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _build_dir() -> Path:
    from ddtree.runtime.paths import cache_dir

    return cache_dir() / "kernels"


@lru_cache(maxsize=1)
def library() -> tuple[ctypes.CDLL | None, str | None]:
    """``(library, None)``, or ``(None, why it cannot run here)``."""
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"needs Linux on x86-64 (this is {sys.platform} on {platform.machine()})"
    missing = NEEDED_FLAGS - _cpu_flags()
    if missing:
        return None, f"this CPU lacks {', '.join(sorted(missing))}"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None, "no C compiler found (install gcc or set CC)"
    src = SOURCE.read_bytes()
    tag = hashlib.sha256(src + " ".join([cc, *FLAGS]).encode()).hexdigest()[:16]
    out = _build_dir() / f"row_invariant_{tag}.so"
    if not out.exists():
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            proc = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp), "-lm"], capture_output=True, text=True,
                                  timeout=180)
            if proc.returncode != 0:
                tmp.unlink(missing_ok=True)
                return None, f"compiling {SOURCE.name} with {cc} failed: {proc.stderr.strip()[-400:]}"
            tmp.replace(out)  # atomic: concurrent processes never load a half-written library
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"building {out} failed: {e} (set DDTREE_CACHE to a writable directory)"
    try:
        lib = ctypes.CDLL(str(out))
    except OSError as e:
        return None, f"loading {out} failed: {e}"
    ptr, long, i32, f64 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_double
    lib.ddtree_row_linear.argtypes = [ptr] * 4 + [long] * 3 + [i32, i32, i32]
    lib.ddtree_row_linear.restype = None
    lib.ddtree_row_attention.argtypes = ([ptr] * 4 + [i32] + [long] * 5 + [ptr] * 4 + [long] + [ptr, ptr]
                                         + [f64, f64, i32])
    lib.ddtree_row_attention.restype = None
    return lib, None


def available() -> bool:
    """Whether the kernels run here (they are built on the first call)."""
    return library()[0] is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False, or None."""
    return library()[1]
