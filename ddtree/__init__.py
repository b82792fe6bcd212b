"""ddtree: lossless tree-based speculative decoding (DDTree) with DFlash block-diffusion drafters.

The top level is what a user of the generator needs: ``SpeculativeGenerator`` and its ``GeneratorOptions``,
the protocols a new drafter or budget policy implements, the output types, and ``decoding`` for
``model.generate(custom_generate=...)``. The pieces of a round, for writing your own loop, are in
:mod:`ddtree.blocks`.
"""

from ddtree import blocks
from ddtree.budget.policy import BudgetPolicy
from ddtree.drafters.base import DraftContext, Drafter, Proposal
from ddtree.generation.generator import GenerationOutput, GenerationStats, SpeculativeGenerator
from ddtree.generation.options import GeneratorOptions
from ddtree.generation.state import RoundResult
from ddtree.integrations.hf import decoding

__version__ = "0.1.0"

__all__ = [
    "SpeculativeGenerator",
    "GeneratorOptions",
    "decoding",
    "Drafter",
    "DraftContext",
    "Proposal",
    "BudgetPolicy",
    "GenerationOutput",
    "GenerationStats",
    "RoundResult",
    "blocks",
    "__version__",
]
