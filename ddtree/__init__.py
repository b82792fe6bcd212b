"""ddtree: lossless tree-based speculative decoding (DDTree) with DFlash block-diffusion drafters."""

from ddtree.budget.policy import AutoBudget, BudgetPolicy, FixedBudget
from ddtree.core.builders import (
    TreeBuilder,
    beam,
    best_first,
    chain,
    ranked_topk,
    resolve_builder,
)
from ddtree.core.masks import tree_attention_mask, tree_position_ids
from ddtree.core.sampling import SamplingConfig, choose_tokens, processed_logprobs
from ddtree.core.tree import DraftTree
from ddtree.core.verify import VerifyResult, accept_longest_branch, verify_tree
from ddtree.drafters.base import DraftContext, Drafter, Proposal
from ddtree.drafters.dflash.config import DFlashConfig
from ddtree.drafters.dflash.context import DFlashContext
from ddtree.drafters.dflash.drafter import DFlashDrafter
from ddtree.drafters.dflash.model import DFlashDraftModel
from ddtree.drafters.features import (
    build_target_layer_ids,
    check_target_layer_ids,
    extract_context_feature,
)
from ddtree.drafters.lookup import PromptLookup, WithLookup
from ddtree.generation.generator import (
    GenerationOutput,
    GenerationStats,
    SpeculativeGenerator,
)
from ddtree.generation.inputs import (
    GenerationSettings,
    StreamerFeed,
    prompt_rows,
    resolve_generation,
    streamed,
)
from ddtree.generation.options import GeneratorOptions
from ddtree.generation.prefill import Prefilled, prefill
from ddtree.generation.round import speculative_round
from ddtree.generation.state import DecodeState, RoundRecord, RoundResult
from ddtree.integrations.hf import DDTreeDecoding, decoding
from ddtree.runtime.threads import ThreadInfo, configure_threads, thread_info
from ddtree.targets.backends import get_backend
from ddtree.targets.cache import (
    cache_kwargs,
    commit_accepted,
    keep_positions,
    new_target_cache,
    padding_mask,
    select_rows,
)
from ddtree.targets.forward import target_forward

__version__ = "0.1.0"

__all__ = [
    "Proposal",
    "SpeculativeGenerator",
    "GeneratorOptions",
    "decoding",
    "DDTreeDecoding",
    "prompt_rows",
    "resolve_generation",
    "GenerationSettings",
    "StreamerFeed",
    "streamed",
    "configure_threads",
    "thread_info",
    "ThreadInfo",
    "GenerationOutput",
    "GenerationStats",
    "RoundRecord",
    "DecodeState",
    "RoundResult",
    "speculative_round",
    "prefill",
    "Prefilled",
    "target_forward",
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashDrafter",
    "Drafter",
    "DraftContext",
    "DFlashContext",
    "build_target_layer_ids",
    "check_target_layer_ids",
    "extract_context_feature",
    "DraftTree",
    "PromptLookup",
    "WithLookup",
    "TreeBuilder",
    "best_first",
    "chain",
    "beam",
    "ranked_topk",
    "resolve_builder",
    "tree_attention_mask",
    "tree_position_ids",
    "get_backend",
    "AutoBudget",
    "BudgetPolicy",
    "FixedBudget",
    "SamplingConfig",
    "choose_tokens",
    "processed_logprobs",
    "VerifyResult",
    "accept_longest_branch",
    "verify_tree",
    "cache_kwargs",
    "commit_accepted",
    "keep_positions",
    "new_target_cache",
    "padding_mask",
    "select_rows",
]
