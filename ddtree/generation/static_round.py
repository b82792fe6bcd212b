"""The static round (``compile=True``): every tree round as three fixed-shape device steps, compiled once.

After the usual prefill, the target cache and the drafter context move into preallocated, row-packed
buffers (:class:`~ddtree.targets.static_cache.RowPackedCache`, the context's ``to_static``), and each round is

1. ``draft``: the drafter's block and the tree under the fixed budget (a tree always has ``budget + 1`` nodes
   for best-first, ``min(budget, D) + 1`` for the chain: the shapes never depend on values);
2. ``verify``: one target forward over the tree at columns ``lengths .. lengths + N - 1`` of every row, with a
   ``[B, 1, N, capacity]`` mask built on the device from the lengths (a GDN hybrid's linear-attention layers
   run each node from its parent's state, in the cache's fixed state buffers: see
   :mod:`ddtree.targets.static_cache`);
   and the target's choice at each node (a keyed draw under sampling: a pure function of the row's key and
   the position, so it needs no RNG state and runs inside the step);
3. ``commit``: the acceptance walk, the accepted nodes' keys/values copied down in place (and GDN states
   replayed along each row's path), their features written into the drafter context, new lengths and roots;

then the round's one host read of the packed accepted tokens. ``tree_budget=0`` runs plain decoding as these
steps (a root-only tree; no drafter context moves into buffers, no hidden states are kept). Rows that finish
keep their place (their lengths stop growing) so the batch shape holds; capacities grow by doubling outside
the steps, so a generation uses a handful of graphs. Each step runs under ``torch.compile(fullgraph=True)``
(on CUDA with ``mode="reduce-overhead"``, CUDA graphs); ``compile="eager"`` or another backend name picks a
``torch.compile`` backend, and the steps' equality with the dynamic round is tested uncompiled and compiled.
Compiling takes seconds to minutes: :class:`CompileLog` says each graph as it compiles, and its seconds. Under
exact numerics the verify's target forward is one operator over the exact kernels
(:class:`~ddtree.targets.exact_static.ExactDecode`), so the tokens keep plain decoding's bits.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch

from ddtree.budget.policy import AutoBudget, FixedBudget
from ddtree.core.builders import TreeBuilder
from ddtree.core.sampling import GREEDY, SamplingConfig, choose_tokens
from ddtree.core.tree import DraftTree, root_only
from ddtree.core.verify import accept_longest_branch
from ddtree.drafters.base import Proposal, StaticDraftContext, coupled_proposal, proposal_tree
from ddtree.generation.accepted import emit_accepted, observe_accepted, pack_accepted, unpack_accepted
from ddtree.generation.state import DecodeState, RoundResult
from ddtree.runtime.log import logger
from ddtree.targets import cpu_linear, exact_static
from ddtree.targets.backends import masks_for_plan, window_plan
from ddtree.targets.cache import cache_kwargs, new_target_cache
from ddtree.targets.description import describe
from ddtree.targets.static_cache import RowPackedCache, commit_packed, packed_tree_mask

CAPACITY_STEP = 256
"""Capacities are this many columns times a power of two, so a generation meets few distinct shapes."""


def capacity_for(need: int) -> int:
    """The smallest bucketed capacity of at least ``need`` columns."""
    cap = CAPACITY_STEP
    while cap < need:
        cap *= 2
    return cap


def check_static_support(generator: Any) -> None:
    """Refuse, before any decoding, what the static round cannot run, naming the reason and the way out."""
    target = generator.target
    if generator.lockstep.active:
        raise ValueError("compile=True runs in one process; a tensor-parallel target (torchrun) runs the dynamic "
                         "round, which keeps the ranks in lockstep. Use compile=False")
    if generator.options.numerics == "exact":
        exact_static.check(target)
        return
    if describe(target).stateful and getattr(new_target_cache(target), "layers", None) is None:
        raise ValueError(f"compile=True runs GDN hybrids on transformers' per-layer cache; this transformers gives "
                         f"{type(target).__name__} a cache without layers (upgrade transformers, or compile=False)")
    if _eager_experts(target):
        raise ValueError(f"compile=True traces the whole verify; {type(target).__name__}'s MoE experts run "
                         "transformers' 'eager' implementation, a loop over the experts each batch hits (its length "
                         "depends on the tokens). Pick a fixed-shape one first, "
                         "target.set_experts_implementation(\"batched_mm\"), or use compile=False")
    if window_plan(target) is None:
        raise ValueError(f"compile=True needs one window per layer type; {type(target).__name__}'s windows differ "
                         "within a type. Use compile=False")
    backend = getattr(generator.backend, "name", None)
    if backend not in ("sdpa", "auto", "fused", "split"):
        raise ValueError(f"compile=True verifies with a dense mask through sdpa; attention={backend!r} is not "
                         "supported with it. Use attention=\"sdpa\" or compile=False")


def _eager_experts(target: Any) -> bool:
    """Whether ``target`` has MoE experts that run transformers' eager loop (the only kind before its experts
    implementations existed)."""
    if not any(name.endswith("experts") for name, _ in target.named_modules()):
        return False
    return getattr(getattr(target, "config", None), "_experts_implementation", None) in (None, "eager")


@dataclass
class StaticRows:
    """One generation's static buffers. Buffer rows never move, so the batch shape holds: a row that finished
    rides along unseen (``alive`` False). ``slots[i]`` is the buffer row of the generation's ``i``-th active row
    (``RowBook.active`` order); the host's bookkeeping (active rows, committed lengths) is the generation's own
    :class:`~ddtree.generation.rows.RowBook`, as in the dynamic round."""

    cache: RowPackedCache
    draft: StaticDraftContext | None  # None: plain decoding (``tree_budget=0``) keeps no drafter context
    lengths: torch.Tensor  # [R] committed positions per buffer row
    roots: torch.Tensor  # [R] each row's last emitted token
    alive: torch.Tensor  # [R] bool
    keys: torch.Tensor | None  # [R] sampling keys (None under greedy)
    slots: list[int]


@functools.cache
def _takes_cache_position(owner: type[torch.nn.Module]) -> bool:
    return "cache_position" in inspect.signature(owner.forward).parameters


class StaticSteps:
    """The three steps of a static round for one target, drafter, builder and budget, compiled on first use.
    ``drafting=False``: plain decoding's steps (budget 0, no drafter context to feed, no hidden states kept).

    Held by the generator (they are derived from its models and settings, and compiling is slow), keyed by
    the builder, budget, decoding rule and ``drafting``."""

    def __init__(self, generator: Any, builder: TreeBuilder, budget: int, compile: bool | str,
                 sampling: SamplingConfig = GREEDY, drafting: bool = True) -> None:
        if not drafting and budget != 0:
            raise ValueError(f"steps that keep no drafter context decode plainly: budget 0, got {budget}")
        self.target = generator.target
        self.sampling = sampling
        self.drafter = generator.drafter
        self.builder = builder
        self.budget, self.drafting = budget, drafting
        self.max_depth = min(budget, self.drafter.block_size - 1)  # a DFlash block proposes block_size - 1 depths
        plan = window_plan(self.target)
        assert plan is not None  # check_static_support refused the rest
        self.plan = plan
        self.layer_types = list(describe(self.target).layer_types)
        self.dtype = generator.dtype
        self.cache_keyword = next(iter(cache_kwargs(self.target, None)))
        self.cache_position = _takes_cache_position(type(self.target))  # type: ignore[arg-type]  # hashable class
        self.hidden = drafting and self.drafter.needs_hidden_states
        # exact numerics: the target's forward as one opaque operator running the eager exact kernels
        self.exact = exact_static.ExactDecode(self.target) if generator.numerics == "exact" else None
        if self.hidden and self.exact is None:
            _install_output_hooks(self.target)
        cuda = self.target.get_input_embeddings().weight.device.type == "cuda"
        self.cuda_graphs = compile is True and cuda
        log: CompileLog = getattr(generator, "compile_log", None) or CompileLog()
        said = log.watch if compile is not False else (lambda fn, step, budget: fn)
        # a plain step's draft is the root alone: a few tensor ops, not a graph worth its guards each step
        self.draft: Callable[..., DraftTree] = (
            self._draft if budget == 0 else said(_compiled(self._draft, compile, cuda), "draft", budget))
        self.propose = said(_compiled(self._propose, compile, cuda), "propose", budget)  # auto's halves of draft
        self.build = said(_compiled(self._build, compile, cuda), "build", budget)
        self.verify = said(_compiled(self._verify, compile, cuda), "verify", budget)
        self.commit = said(_compiled(self._commit, compile, cuda), "commit", budget)

    def _draft(self, draft: StaticDraftContext, roots: torch.Tensor, lengths: torch.Tensor,
               keys: torch.Tensor | None) -> DraftTree:
        if self.budget == 0:  # a plain step: the root alone, no drafter forward
            return root_only(roots)
        return self._build(self._propose(draft, roots, lengths, keys), roots)

    def _propose(self, draft: StaticDraftContext, roots: torch.Tensor, lengths: torch.Tensor,
                 keys: torch.Tensor | None) -> Proposal:
        proposal = draft.propose(roots, lengths)
        if keys is not None:  # coupled drafting (the generation's coupled_drafts)
            proposal = coupled_proposal(proposal, self.sampling, keys, lengths)
        return proposal

    def _build(self, proposal: Proposal, roots: torch.Tensor) -> DraftTree:
        return proposal_tree(proposal, roots, self.builder, self.budget)

    def _verify(self, cache: RowPackedCache, tree: DraftTree, lengths: torch.Tensor,
                keys: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = tree.num_nodes
        positions = lengths[:, None] + tree.depths + 1  # each node chooses the token after it
        if self.exact is not None:
            logits, hidden_states = self.exact(tree.tokens, lengths[:, None] + tree.depths, cache.keys, cache.values,
                                               lengths, tree.visibility, tree.depths,
                                               self.drafter.target_layer_ids if self.hidden else None)
            features = self.drafter.context_features(hidden_states) if hidden_states is not None else None
            return choose_tokens(logits, self.sampling, keys=keys, positions=positions), features
        cache.set_write_columns(lengths[:, None] + torch.arange(n, device=lengths.device))
        cache.set_tree(tree.parents, tree.depths, self.max_depth)  # for stateful layers, if any
        capacity = cache.keys[0].shape[2]

        def mask(window: int | None) -> torch.Tensor:
            return packed_tree_mask(tree.visibility, tree.depths, lengths, capacity, self.dtype, window)

        extra: dict[str, Any] = {self.cache_keyword: cache}
        if self.cache_position:  # transformers that derive it from the cache's length otherwise; unused by it
            extra["cache_position"] = torch.arange(n, device=lengths.device)
        hidden = self.hidden
        out = self.target(input_ids=tree.tokens, position_ids=lengths[:, None] + tree.depths,
                          attention_mask=masks_for_plan(self.plan, self.layer_types, mask), use_cache=True,
                          output_hidden_states=hidden, **extra)
        features = self.drafter.context_features(out.hidden_states) if hidden else None
        return choose_tokens(out.logits, self.sampling, keys=keys, positions=positions), features

    def _commit(self, cache: RowPackedCache, draft: StaticDraftContext | None, tree: DraftTree, choices: torch.Tensor,
                features: torch.Tensor | None, lengths: torch.Tensor,
                alive: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = tree.num_nodes
        result = accept_longest_branch(tree, choices, length=n)
        if n > 1:  # a root-only tree's keys and values are already where the commit would move them
            commit_packed(cache.keys, cache.values, lengths, result.accepted)
        cache.commit_states(result.accepted[:, : self.max_depth + 1], alive)  # stateful layers, if any
        path = result.accepted.clamp(min=0)
        if draft is not None:
            if features is not None:
                features = features.gather(1, path[..., None].expand(-1, -1, features.shape[-1]))
            draft.append(features, tree.tokens.gather(1, path), lengths)
        new_lengths = lengths + torch.where(alive, result.num_accepted, torch.zeros_like(result.num_accepted))
        return pack_accepted(tree, result), new_lengths, result.bonus


class CompileLog:
    """Says, through the ``ddtree`` logger (:mod:`ddtree.runtime.log`), each graph the static round compiles: the
    step, its budget and buffer shape, the count so far, and the seconds it took. Held by a generator, so the
    count runs over all its calls. ``clock``: seconds, injectable."""

    HEADER = ("compile: compiling the static round's steps, 3 graphs per tree budget (draft, verify, commit; "
              "under \"auto\" propose and build in place of draft) and again when the buffers grow; each takes "
              "seconds to minutes on a CPU (quiet: logging.getLogger('ddtree').setLevel('WARNING'))")

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.graphs = 0
        self.seconds = 0.0

    def watch(self, fn: Callable, step: str, budget: int) -> Callable:
        """``fn`` (a compiled step), saying each compile that a call of it runs."""

        @functools.wraps(fn)
        def call(*args: Any) -> Any:
            with self._compiles(step, budget, _shape_note(args)):
                return fn(*args)

        return call

    @contextlib.contextmanager
    def _compiles(self, step: str, budget: int, shape: str) -> Iterator[None]:
        started: list[float] = []

        def start(args: Any = None) -> None:
            if not _dynamo_trigger(args):
                return
            log = logger()
            if self.graphs == 0 and not started:
                log.info(self.HEADER)
            log.info(f"compiling graph {self.graphs + 1}: the {step} step, budget {budget}{shape} ...")
            started.append(self.clock())

        def end(args: Any = None) -> None:
            if not _dynamo_trigger(args) or not started:
                return
            took = self.clock() - started.pop()
            self.graphs += 1
            self.seconds += took
            logger().info(f"compiled graph {self.graphs} ({step}, budget {budget}) in {took:.1f} s; "
                          f"{self.graphs} graph{'s' if self.graphs > 1 else ''} in {self.seconds:.1f} s so far")

        with _compile_callbacks(start, end):
            yield


def _shape_note(args: tuple) -> str:
    """``, B rows, capacity C`` from a step's arguments (the shapes a new graph is compiled for)."""
    rows = next((a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() >= 1), None)
    capacity = next((a.capacity for a in args if isinstance(getattr(a, "capacity", None), int)), None)
    return (f", {rows} row{'s' if rows != 1 else ''}" if rows is not None else "") + \
        (f", capacity {capacity}" if capacity is not None else "")


def _dynamo_trigger(args: Any) -> bool:
    """Whether a compile callback is dynamo compiling a frame (not a CUDA-graph recording or a lazy backward)."""
    trigger = getattr(args, "callback_trigger", None)
    return trigger is None or getattr(trigger, "name", "DYNAMO") == "DYNAMO"


@contextlib.contextmanager
def _compile_callbacks(start: Callable, end: Callable) -> Iterator[None]:
    """``start`` and ``end`` called as dynamo starts and ends a compile within the block (nothing where this torch
    has no compile callbacks)."""
    handler: Any = None
    try:
        from torch._dynamo.callback import callback_handler as handler
    except ImportError:  # an older torch: compiles unannounced
        pass
    if handler is None:
        yield
        return
    handler.register_start_callback(start)
    handler.register_end_callback(end)
    try:
        yield
    finally:
        handler.remove_start_callback(start)
        handler.remove_end_callback(end)


def _install_output_hooks(target: Any) -> None:
    """One tiny eager forward with ``output_hidden_states``: transformers installs the hooks that collect
    hidden states on first use, under a thread lock a compiled step cannot trace."""
    device = target.get_input_embeddings().weight.device
    with torch.inference_mode():
        target(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False,
               output_hidden_states=True)


STEP_GRAPHS_MOST = 64
"""Graphs one compiled step of one budget may hold: one per batch size and buffer capacity it meets (dynamo's own
limit, 8, would make the ninth batch size a hard error under ``fullgraph=True``)."""


def _compiled(fn: Callable, compile: bool | str, cuda: bool = False) -> Callable:
    """``fn`` under ``torch.compile(fullgraph=True)`` (inductor; CUDA graphs for a CUDA target), another backend
    by name, or as it is for ``compile=False`` (the static round uncompiled: the tests' reference)."""
    if compile is False:
        return fn
    fn = _own_code(fn)
    limit = _graph_limit()
    options = _unguarded_modules()
    if compile is True:
        if cuda:  # CUDA graphs ("reduce-overhead"; a CPU target on a CUDA machine gets none)
            options.update(torch._inductor.list_mode_options("reduce-overhead"))
        return torch.compile(fn, fullgraph=True, dynamic=False, options=options, **limit)
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=compile, options=options, **limit)


def _unguarded_modules() -> dict[str, Any]:
    """``torch.compile`` options that drop dynamo's guards on module state (parameters' metadata, attributes,
    hooks, configs), where this torch has the filter: checked at every call of every step, they cost more than
    a millisecond a step on a CPU. The generation checks the same once instead (:func:`traced_state`)."""
    skip = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
    return {} if skip is None else {"guard_filter_fn": skip}


_SETTINGS = frozenset({bool, int, float, str, type(None)})
"""Module attributes of these types are settings a trace makes constants of (``training``, an epsilon)."""


def traced_state(*models: Any) -> tuple:
    """What compiled steps assume of ``models`` and their guards no longer check (:func:`_unguarded_modules`):
    each module's class, own ``forward`` (a routed linear's), hooks and plain settings (its mode, an
    epsilon), each parameter's and buffer's dtype, device, shape and grad flag, and the config. Read once a
    generation; a change rebuilds the steps."""
    parts: list[Any] = []
    for model in models:
        if not isinstance(model, torch.nn.Module):
            continue
        config = getattr(model, "config", None)
        parts.append(repr(sorted(vars(config).items())) if config is not None else None)
        parts.extend((type(m), m.__dict__.get("forward"), tuple(m._forward_hooks.values()),
                      tuple(m._forward_pre_hooks.values()),
                      tuple([(k, v) for k, v in vars(m).items() if type(v) in _SETTINGS]))
                     for m in model.modules())
        parts.extend((t.dtype, t.device, t.shape, t.requires_grad)
                     for t in (*model.parameters(), *model.buffers()))
    return tuple(parts)


def _own_code(method: Callable) -> Callable:
    """``method`` bound to a copy of its code object. Dynamo keeps graphs and counts recompiles per code object:
    with a copy, each budget's steps hold their own graphs (a sweep over budgets in one process meets no
    recompile limit, a call checks no other budget's guards) and free them with the steps."""
    fn = getattr(method, "__func__", method)
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__qualname__ = fn.__qualname__
    owner = getattr(method, "__self__", None)
    return own if owner is None else types.MethodType(own, owner)


def _graph_limit() -> dict[str, Any]:
    """``torch.compile``'s per-call recompile limit set to :data:`STEP_GRAPHS_MOST` where it takes one; an older
    torch has only the process-wide limit, which is raised to it (never lowered)."""
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return {"recompile_limit": STEP_GRAPHS_MOST}
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), STEP_GRAPHS_MOST))
    return {}


def static_budget(state: DecodeState) -> int | None:
    """The fixed budget the static round compiles for, or ``None`` for the adaptive policy (``"auto"``), which
    picks among :func:`compiled_ladder`'s budgets each round."""
    policy = state.policy
    if isinstance(policy, FixedBudget):
        return policy.budget
    if isinstance(policy, AutoBudget):
        return None
    raise ValueError(f"compile=True takes a fixed int tree_budget or \"auto\" (each tree size is its own "
                     f"compiled graph); got the policy {type(policy).__name__}. Pass tree_budget=N or compile=False")


COMPILED_LADDER_TOP = {"cpu": 8}
"""The largest budget of the compiled ladder by device type (each rung is its own graphs): twice the fixed
compiled default on a CPU; an accelerator verifies wide trees nearly for free and gets
:data:`COMPILED_LADDER_TOP_ACCELERATOR`."""
COMPILED_LADDER_TOP_ACCELERATOR = 64


def compiled_ladder(device: torch.device) -> tuple[int, ...]:
    """The budgets ``"auto"`` chooses among under ``compile=True``: powers of two up to the device's top rung
    (a plain step, budget 0, is always a choice besides)."""
    top = COMPILED_LADDER_TOP.get(device.type, COMPILED_LADDER_TOP_ACCELERATOR)
    return tuple(2**i for i in range(top.bit_length()) if 2**i <= top)


def to_static(state: DecodeState) -> StaticRows:
    """Move a prefilled generation's cache and drafter context into static buffers."""
    held, book = state.on_device, state.rows
    gen = state.generator
    prepared = describe(gen.target).numerics
    if prepared != gen.numerics:
        raise RuntimeError(f"this generator runs compile=True with numerics={gen.numerics!r}, but a "
                           f"generator built later on its target prepared it for numerics={prepared!r} (the last "
                           "generator built prepares a target): build a new SpeculativeGenerator for this target")
    gen.keep_static_steps()
    for model in (gen.target, getattr(gen.drafter, "cpu_linear_model", None)):
        if isinstance(model, torch.nn.Module):
            cpu_linear.pack_routed(model)  # the compiled steps read routed linears' packed weights, current ones
    capacity = capacity_for(max(book.host_lengths) + state.generator.drafter.block_size + 1)
    static_draft = None  # plain decoding keeps no drafter context
    if state.policy is not None:
        draft = state.catch_up_draft()
        to_static_draft = getattr(draft, "to_static", None)
        if to_static_draft is None:
            raise ValueError(f"compile=True needs a drafter context with to_static (DFlash); "
                             f"{type(draft).__name__} has none. Use compile=False")
        static_draft = to_static_draft(capacity)
    cache = RowPackedCache.from_cache(held.cache, book.host_lengths, capacity)
    lengths = cast(torch.Tensor, held.lengths)  # set by the prefill
    rows = StaticRows(cache=cache, draft=static_draft, lengths=lengths.clone(),
                      roots=cast(torch.Tensor, held.roots).clone(),
                      alive=torch.ones(len(book.active), dtype=torch.bool, device=lengths.device), keys=held.keys,
                      slots=list(range(len(book.active))))  # the device state holds the active rows in order
    held.cache = cache
    return rows


def static_round(state: DecodeState, steps: StaticSteps, rows: StaticRows,
                 tree: DraftTree | None = None, reason: str = "fixed") -> RoundResult:
    """One static round for every buffer row (finished ones ride along unseen); returns what each row committed.
    ``tree``: this round's trees when the caller drafted them (the adaptive budget; its CUDA-graph generation
    already begun), else the steps draft them; ``reason``: the policy's for the budget."""
    timer, book, held = state.timer, state.rows, state.on_device
    need = max(book.host_lengths) + steps.budget + 1
    if need > rows.cache.capacity:
        capacity = capacity_for(need)
        rows.cache = rows.cache.grown(capacity)
        if rows.draft is not None:
            rows.draft.reserve(capacity)
        held.cache = rows.cache
    if steps.cuda_graphs and tree is None:
        # One round is one CUDA-graph generation: draft, verify and commit run as a path of graphs whose
        # outputs stay valid until the next round. Without the mark, each step counts as a new generation
        # and the draft's tree is overwritten before verify reads it. What outlives the round is cloned.
        torch.compiler.cudagraph_mark_step_begin()
    if tree is None:
        with timer.stage("draft"):
            tree = steps.draft(rows.draft, rows.roots, rows.lengths, rows.keys if state.coupled_drafts else None)
    with timer.stage("verify"):
        rows.cache.reserve_nodes(tree.num_nodes)
        choices, features = steps.verify(rows.cache, tree, rows.lengths, rows.keys)
    with timer.stage("commit"):
        packed, lengths, roots = steps.commit(rows.cache, rows.draft, tree, choices, features, rows.lengths,
                                              rows.alive)
        rows.lengths, rows.roots = lengths.clone(), roots.clone()  # outputs a later replay may overwrite
        host = unpack_accepted(packed.tolist(), tree).select(rows.slots)  # the round's one host read
    observe_accepted(state, tree, host, steps.budget if steps.drafting else None, tree_rows=rows.slots,
                     reason=reason)
    tokens, acceptance = emit_accepted(state, host)
    finished = [row for row in book.active if book.finished[row]]
    if finished:
        rows.slots = [rows.slots[i] for i in book.drop_finished()]
        alive = [False] * len(rows.alive)
        for slot in rows.slots:
            alive[slot] = True
        rows.alive = torch.tensor(alive, dtype=torch.bool, device=rows.lengths.device)
        if not book.active:
            held.release()
    return RoundResult(tokens, acceptance, finished)
