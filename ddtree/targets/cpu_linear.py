"""A few-row float32 linear for CPU targets: the verify forward's bottleneck.

A tree verify pushes 2-32 tokens through the target at once. On a CPU the
weights are streamed from memory for every forward, so such a forward could
cost about as much as a one-token step, but the BLAS small-M paths reach only
half that speed or less. The kernel in ``csrc/skinny_linear.c`` streams each
weight row once and applies it to all rows, and it sums every output in the
same order whatever the row count, so a token's activations in these layers do
not depend on how many tokens share its forward (verify and plain decode agree
bit for bit here).

It is compiled once with the system C compiler (AVX2 + FMA, OpenMP) into the
ddtree cache directory and loaded with ctypes. Where that is impossible
(another CPU, no compiler, autograd, another dtype) :func:`linear` is plain
``torch.nn.functional.linear``. Under ``torch.compile`` it is plain
``F.linear`` as well: a traced graph cannot call into ctypes, and the compiler
makes its own matmuls, so a routed model (one another generator shares) still
compiles whole.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).with_name("csrc") / "skinny_linear.c"
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
DEFAULT_MAX_ROWS = 32  # above this BLAS is as fast (prefill always goes to BLAS)

_INSTALLED = "_ddtree_cpu_linear"


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
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """(library, None) or (None, why not)."""
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"needs Linux on x86-64 (this is {sys.platform} on {platform.machine()})"
    missing = {"avx2", "fma"} - _cpu_flags()
    if missing:
        return None, f"this CPU lacks {', '.join(sorted(missing))}"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None, "no C compiler found (install gcc or set CC)"
    src = SOURCE.read_bytes()
    tag = hashlib.sha256(src + " ".join([cc, *FLAGS]).encode()).hexdigest()[:16]
    out = _build_dir() / f"skinny_linear_{tag}.so"
    if not out.exists():
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            proc = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True,
                                  timeout=120)
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
    fn = lib.ddtree_skinny_linear
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    fn.restype = None
    return lib, None


def available() -> bool:
    """Whether the kernel runs here (it is built on the first call)."""
    return _load()[0] is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False, or None."""
    return _load()[1]


def _use_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int, max_rows: int) -> bool:
    if rows == 0 or rows > max_rows or x.device.type != "cpu" or weight.device.type != "cpu":
        return False
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or not weight.is_contiguous():
        return False
    if bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu" or not bias.is_contiguous()):
        return False
    needs_grad = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if torch.is_grad_enabled() and needs_grad:
        return False  # no backward
    return _load()[0] is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           max_rows: int = DEFAULT_MAX_ROWS) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; through the kernel when ``x`` has at most ``max_rows`` rows."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: input has {x.shape[-1]} features but the weight {tuple(weight.shape)} expects "
                         f"{weight.shape[1] if weight.dim() == 2 else '?'} (weight must be [out, in])")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"linear: bias has shape {tuple(bias.shape)}, expected ({weight.shape[0]},)")
    if torch.compiler.is_compiling():  # decided at trace time: the traced graph holds torch's own linear
        return F.linear(x, weight, bias)
    k, n = weight.shape[1], weight.shape[0]
    rows = x.numel() // k if k else 0
    lib = _load()[0] if _use_kernel(x, weight, bias, rows, max_rows) else None
    if lib is None:
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, k).contiguous()
    y = torch.empty(rows, n, dtype=torch.float32)
    lib.ddtree_skinny_linear(x2.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                             y.data_ptr(), rows, k, n, torch.get_num_threads())
    return y.view(*x.shape[:-1], n)


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias, getattr(self, _INSTALLED))


def install(model: torch.nn.Module, max_rows: int = DEFAULT_MAX_ROWS) -> int:
    """Route ``model``'s float32 CPU ``nn.Linear`` layers through :func:`linear`; returns how many.

    Calls with more than ``max_rows`` rows (a prompt's prefill) still use BLAS.
    Raises if the kernel cannot run here; :func:`uninstall` undoes it.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    if not available():
        raise RuntimeError(f"the ddtree CPU linear kernel is unavailable: {unavailable_reason()}")
    count = 0
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear) and mod.weight.dtype == torch.float32 and mod.weight.device.type == "cpu":
            setattr(mod, _INSTALLED, int(max_rows))
            mod.forward = types.MethodType(_forward, mod)  # type: ignore[method-assign]  # patches this instance
            count += 1
    return count


def uninstall(model: torch.nn.Module) -> int:
    """Give ``model``'s linears back their own forward; returns how many were routed."""
    count = 0
    for mod in model.modules():
        if hasattr(mod, _INSTALLED):
            delattr(mod, _INSTALLED)
            del mod.forward
            count += 1
    return count


def routed(layer: torch.nn.Linear) -> bool:
    """Whether this one linear goes through the kernel (O(1), for per-round checks)."""
    return hasattr(layer, _INSTALLED)


def installed(model: torch.nn.Module) -> int:
    """How many of ``model``'s linears go through the kernel."""
    return sum(1 for mod in model.modules() if hasattr(mod, _INSTALLED))


@contextmanager
def suspended(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Run the block with ``model``'s own linears (a stock baseline), then route them again."""
    saved = [(mod, getattr(mod, _INSTALLED)) for mod in model.modules() if hasattr(mod, _INSTALLED)]
    uninstall(model)
    try:
        yield model
    finally:
        for mod, max_rows in saved:
            setattr(mod, _INSTALLED, max_rows)
            mod.forward = types.MethodType(_forward, mod)
