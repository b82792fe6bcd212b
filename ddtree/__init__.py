"""ddtree: lossless tree-based speculative decoding (DDTree) with DFlash block-diffusion drafters."""

from .attention import get_backend
from .budget import AutoBudget, BudgetPolicy, FixedBudget
from .cache import cache_kwargs, commit_accepted, keep_positions, new_target_cache
from .drafter import DFlashConfig, DFlashContext, DFlashDraftModel, DFlashDrafter, DraftContext, Drafter
from .features import build_target_layer_ids, check_target_layer_ids, extract_context_feature
from .generator import GenerationOutput, GenerationStats, SpeculativeGenerator
from .round import speculative_round, target_forward
from .state import DecodeState, RoundRecord, RoundResult
from .hf import DDTreeDecoding, decoding
from .inputs import GenerationSettings, StreamerFeed, prompt_rows, resolve_generation, streamed
from .threads import ThreadInfo, configure_threads, thread_info
from .lookup import PromptLookup, WithLookup
from .masks import tree_attention_mask, tree_position_ids
from .sampling import SamplingConfig, choose_tokens, processed_logprobs
from .tree import DraftTree, TreeBuilder, beam, best_first, chain, ranked_topk, resolve_builder
from .verify import VerifyResult, accept_longest_branch, verify_tree

__version__ = "0.1.0"

__all__ = [
    "SpeculativeGenerator",
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
]
