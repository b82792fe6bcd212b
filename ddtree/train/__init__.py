"""``python -m ddtree.train``: train a DFlash drafter for any Hugging Face causal LM target.

See :mod:`ddtree.train.config` for the knobs, :mod:`ddtree.train.data` for the
self-distillation / plain-text data and the feature cache, and
:mod:`ddtree.train.loop` for the training loop, :mod:`ddtree.train.parallel` for data-parallel
training under ``torchrun``, and :mod:`ddtree.train.acceptance` for the export's acceptance measured
through ddtree's own generation. The guide is ``docs/train.md``.
"""

from ddtree.train.config import TrainConfig, parse_args
from ddtree.train.loop import evaluate, make_batch, train

__all__ = ["TrainConfig", "parse_args", "train", "evaluate", "make_batch", "run", "pick_mask_token"]


def __getattr__(name):
    if name in ("run", "pick_mask_token", "prepare_data"):
        from ddtree.train import __main__ as m

        return getattr(m, name)
    raise AttributeError(name)
