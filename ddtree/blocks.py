"""The building blocks of a speculative round, in one namespace, for writing your own decoding loop.

``ddtree`` itself holds only what a user of the generator needs; a custom loop (draft -> build a tree ->
one masked target forward -> verify -> commit, or the generator's own round driven by your loop) takes its
pieces from here. ``examples/custom_loop.py`` is a full loop written only with them. Each name lives in its
own layer module; the README's "Building blocks" table lists every name here (``tests/test_surface.py``
checks that both ways). Helpers not listed here stay importable from their own modules.
"""

from ddtree.budget.policy import AutoBudget, BudgetPolicy, FixedBudget
from ddtree.core.builders import TreeBuilder, beam, best_first, chain, resolve_builder
from ddtree.core.graft import Branches, graft_paths
from ddtree.core.masks import tree_attention_mask, tree_position_ids
from ddtree.core.noise import row_keys
from ddtree.core.pairwise import PairwiseScores, best_first_pairwise, chain_pairwise
from ddtree.core.sampling import SamplingConfig, choose_tokens, processed_logprobs
from ddtree.core.tree import DraftTree
from ddtree.core.verify import VerifyResult, accept_longest_branch, verify_tree
from ddtree.drafters.base import DraftContext, Drafter, Proposal, coupled_proposal, proposal_tree
from ddtree.drafters.dflash.config import DFlashConfig
from ddtree.drafters.dflash.context import DFlashContext
from ddtree.drafters.dflash.drafter import DFlashDrafter
from ddtree.drafters.dflash.model import DFlashDraftModel
from ddtree.drafters.dflash2.drafter import DFlash2Drafter
from ddtree.drafters.features import build_target_layer_ids, check_target_layer_ids, extract_context_feature
from ddtree.drafters.lookup import PromptLookup, WithLookup
from ddtree.drafters.registry import register_drafter
from ddtree.generation.inputs import GenerationSettings, StreamerFeed, prompt_rows, resolve_generation, streamed
from ddtree.generation.prefill import Prefilled, prefill
from ddtree.generation.round import speculative_round
from ddtree.generation.state import DecodeState, RoundResult
from ddtree.generation.stats import RoundRecord
from ddtree.runtime.distributed import Lockstep, fail_together
from ddtree.runtime.threads import ThreadInfo, configure_threads, thread_info
from ddtree.targets import cpu_linear
from ddtree.targets.backends import TreeAttentionBackend, get_backend
from ddtree.targets.cache import commit_accepted, new_target_cache, padding_mask, select_rows
from ddtree.targets.description import TargetDescription, describe
from ddtree.targets.exact_layers import unchanged_between_forwards
from ddtree.targets.forward import target_forward
from ddtree.targets.layer_kinds import STATEFUL_KINDS, StatefulLayerKind
from ddtree.targets.linear_attention import GatedDeltaNet
from ddtree.targets.numerics import exact_unavailable, prepare_exact

# In the order of the README's table.
__all__ = [
    # target features
    "extract_context_feature", "build_target_layer_ids", "check_target_layer_ids",
    # one whole round, on a per-call state
    "speculative_round", "DecodeState", "RoundResult", "RoundRecord",
    # draft: the protocol, DFlash, the drafter registry
    "Drafter", "DraftContext", "Proposal", "DFlashDrafter", "DFlashContext", "DFlashConfig", "DFlashDraftModel",
    "register_drafter",
    # tree
    "DraftTree", "Branches", "graft_paths", "proposal_tree", "TreeBuilder", "best_first", "chain", "beam",
    "resolve_builder",
    # prompt lookup
    "PromptLookup", "WithLookup",
    # mask and positions
    "tree_attention_mask", "tree_position_ids",
    # attention backends, target description
    "get_backend", "TreeAttentionBackend", "describe", "TargetDescription",
    # verify
    "verify_tree", "accept_longest_branch", "VerifyResult",
    # target forward, cache, commit
    "target_forward", "new_target_cache", "commit_accepted",
    # batched prefill
    "prefill", "Prefilled",
    # padded rows, dropping finished rows
    "padding_mask", "select_rows",
    # budget per round
    "FixedBudget", "AutoBudget", "BudgetPolicy",
    # decoding rule
    "SamplingConfig", "choose_tokens", "processed_logprobs",
    # keyed draws
    "row_keys", "coupled_proposal",
    # few-row CPU linears; exact numerics (row-invariant kernels)
    "cpu_linear", "prepare_exact", "exact_unavailable", "unchanged_between_forwards",
    # HF inputs, settings, streamers
    "prompt_rows", "resolve_generation", "GenerationSettings", "streamed", "StreamerFeed",
    # thread count
    "configure_threads", "thread_info", "ThreadInfo",
    # stateful layer kinds (hybrid GDN)
    "StatefulLayerKind", "STATEFUL_KINDS", "GatedDeltaNet",
    # ranks that must decide alike
    "Lockstep", "fail_together",
    # DFlash2 and pairwise trees
    "DFlash2Drafter", "best_first_pairwise", "chain_pairwise", "PairwiseScores",
]
