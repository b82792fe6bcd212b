"""The row-invariant C kernels (``csrc/row_invariant.c``), built once with the system compiler and loaded.

The library is compiled on first use (for this CPU's vector width, or AVX2 + FMA + F16C; OpenMP) into the
ddtree cache directory, named by a hash of its source, flags and CPU, and loaded with ctypes. Where it cannot be
(another CPU, no compiler, an unwritable cache) :func:`library` says why, and the callers fall back or refuse
with that reason.
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
COMMON = ["-O3", "-fopenmp", "-shared", "-fPIC"]
ARCH_FLAGS = {
    "native": ["-march=native"],  # this CPU's widest vectors (AVX-512, AVX512-BF16) and AMX tiles where it has them
    "vector": ["-march=native", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"],  # the same without AMX
    "avx2": ["-mavx2", "-mfma", "-mf16c"],  # any x86-64 CPU with AVX2, FMA and F16C
}
"""``DDTREE_KERNEL_ARCH`` picks one (default ``native``, falling back to ``avx2`` where the compiler refuses it).
Each build sums in its own fixed order: exact numerics compares a machine with itself, never across builds."""
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
    arch = os.environ.get("DDTREE_KERNEL_ARCH", "native")
    if arch not in ARCH_FLAGS:
        return None, f"DDTREE_KERNEL_ARCH must be one of {', '.join(ARCH_FLAGS)}, got {arch!r}"
    out, why = _build(cc, arch)
    if out is None and arch == "native":  # a compiler that does not know this CPU: the portable build
        out, why = _build(cc, "avx2")
    if out is None:
        return None, why
    try:
        lib = ctypes.CDLL(str(out))
    except OSError as e:
        return None, f"loading {out} failed: {e}"
    ptr, long, i32, f64 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_double
    lib.ddtree_row_linear.argtypes = [ptr] * 4 + [long] * 3 + [i32, i32, i32]
    lib.ddtree_row_linear.restype = None
    lib.ddtree_packed_bytes.argtypes = [long, long, i32]
    lib.ddtree_packed_bytes.restype = long
    lib.ddtree_pack_weight.argtypes = [ptr, ptr, long, long, i32, i32]
    lib.ddtree_pack_weight.restype = None
    lib.ddtree_packed_linear.argtypes = [ptr] * 4 + [long] * 3 + [i32, i32, ptr, long]
    lib.ddtree_packed_linear.restype = None
    lib.ddtree_compact_rows.argtypes = [ptr] + [long] * 5 + [ptr] * 3 + [long, long, i32]
    lib.ddtree_compact_rows.restype = None
    strides = ctypes.POINTER(long)
    lib.ddtree_row_attention.argtypes = [ptr] * 4 + [i32] + [long] * 5 + [strides] * 3 + [ptr] * 4 + [f64, f64, i32]
    lib.ddtree_row_attention.restype = None
    lib.ddtree_rms_norm.argtypes = [ptr] * 3 + [long] * 4 + [f64, i32, i32, i32]
    lib.ddtree_rms_norm.restype = None
    lib.ddtree_rotary.argtypes = [ptr] * 3 + [long] * 4 + [i32, i32]
    lib.ddtree_rotary.restype = None
    lib.ddtree_silu_mul.argtypes = [ptr] * 3 + [long] * 5 + [i32, i32]
    lib.ddtree_silu_mul.restype = None
    lib.ddtree_decoder_layer.argtypes = [ptr, ptr]
    lib.ddtree_decoder_layer.restype = None
    lib.ddtree_decoder_stack.argtypes = [ptr, ptr, long, ptr]
    lib.ddtree_decoder_stack.restype = i32
    lib.ddtree_decoder_stack_slots.argtypes = []
    lib.ddtree_decoder_stack_slots.restype = long
    lib.ddtree_decoder_layer_slots.argtypes = []
    lib.ddtree_decoder_layer_slots.restype = long
    lib.ddtree_uses_amx.argtypes = []
    lib.ddtree_uses_amx.restype = i32
    return lib, None


def _build(cc: str, arch: str) -> tuple[Path | None, str | None]:
    """The library built for ``arch`` (once per source, compiler, flags and, for this CPU's builds, CPU)."""
    flags = [*COMMON, *ARCH_FLAGS[arch]]
    cpu = " ".join(sorted(_cpu_flags())) if "-march=native" in flags else ""
    tag = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *flags, cpu]).encode()).hexdigest()[:16]
    out = _build_dir() / f"row_invariant_{arch}_{tag}.so"
    if out.exists():
        return out, None
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([cc, *flags, str(SOURCE), "-o", str(tmp), "-lm"], capture_output=True, text=True,
                              timeout=180)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            return None, f"compiling {SOURCE.name} with {cc} failed: {proc.stderr.strip()[-400:]}"
        tmp.replace(out)  # atomic: concurrent processes never load a half-written library
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"building {out} failed: {e} (set DDTREE_CACHE to a writable directory)"
    return out, None


def available() -> bool:
    """Whether the kernels run here (they are built on the first call)."""
    return library()[0] is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False, or None."""
    return library()[1]


def uses_paired_bf16() -> bool:
    """Whether bfloat16 products run on the AVX512-BF16 dot product here (a ``native`` build on a CPU with it)."""
    lib = library()[0]
    return bool(lib is not None and lib.ddtree_uses_paired_bf16())


def uses_amx() -> bool:
    """Whether bfloat16 products run on AMX tiles here: a ``native`` build on a CPU with AMX-BF16 whose kernel
    lets this process use them (the first call asks; every product after it, of any row count, uses the same)."""
    lib = library()[0]
    return bool(lib is not None and lib.ddtree_uses_amx())
