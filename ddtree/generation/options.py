"""``GeneratorOptions``: every setting of a :class:`~ddtree.generation.generator.SpeculativeGenerator`, checked once.

One frozen dataclass (nanoGPT's config style), so that a generator's settings can be read, printed, copied
and overridden in one place: ``options.replace(builder="chain")`` is a new, checked copy. The checks stay
with the code they guard (the budget, the prefill, the builders, the attention backends); this module calls
them all when an options object is made, so a bad setting fails before any model is touched.

Two kinds of setting:

- per generation (:data:`PER_CALL`): ``tree_budget``, ``builder``, ``prefill_chunk``, ``coupled_drafts``; also
  accepted by
  ``generate`` / ``stream`` / ``start`` for one call;
- per model (:data:`MODEL_SETTINGS`): ``attention``, ``cpu_linear``, ``threads``, ``compile``,
  ``prompt_lookup``; they prepare or change the models (or the process), so they are set on the generator
  only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ddtree.budget.policy import AutoBudget, BudgetPolicy, FixedBudget, check_budget
from ddtree.core.builders import TreeBuilder, resolve_builder
from ddtree.targets.backends import get_backend
from ddtree.targets.forward import PREFILL_CHUNK, check_prefill_chunk
from ddtree.targets.numerics import check_numerics

COUPLED_FROM_TEMPERATURE = 1.0
"""``coupled_drafts=None`` couples from this temperature up: on the default pair coupling raised tokens per round
by 5-14% at T = 1.2 and up to 5% at 1.0, and left them within noise or lower below (-5% at 0.6; a random
drafter on a sharp tiny target with top-k 3 at T = 0.8 accepted less coupled). docs/benchmarks.md."""


def coupled_at(coupled_drafts: bool | None, temperature: float) -> bool:
    """Whether a generation at ``temperature`` builds coupled trees (greedy never does: nothing is drawn)."""
    if temperature == 0:
        return False
    return temperature >= COUPLED_FROM_TEMPERATURE if coupled_drafts is None else coupled_drafts


PER_CALL = ("tree_budget", "builder", "prefill_chunk", "coupled_drafts")
"""Settings a single ``generate`` / ``stream`` / ``start`` call may override."""
MODEL_SETTINGS = ("attention", "cpu_linear", "threads", "compile", "prompt_lookup", "numerics")
"""Settings that prepare the models or the process: set on the generator, refused per call."""


@dataclass(frozen=True)
class GeneratorOptions:
    """The settings of a ``SpeculativeGenerator``; see its docstring for what each one does.

    ``tree_budget=None`` means the default, ``"auto"`` (a fixed budget for the device under ``compile``; the
    generator fills it in);
    ``threads=None`` leaves torch's thread count as it is.
    ``prompt_lookup``: merge a prompt-lookup branch (:class:`~ddtree.drafters.lookup.WithLookup`) into every
    tree, under the same budget (on by default; prompt lookup itself, or a drafter that merges it already, is kept
    as it is).
    ``cpu_linear`` holds under ``compile`` too: a compiled step calls the routed linears' kernel as one operator
    each (:mod:`ddtree.targets.kernel_ops`).
    ``coupled_drafts``: under sampling, trees are built from the drafter's tempered scores plus the target's
    keyed noise (:func:`~ddtree.drafters.base.coupled_proposal`), so the drafter's first guess is its own sample
    under the target's draw; the tokens are the same either way, the acceptance is not. ``None`` (the default):
    on from temperature :data:`COUPLED_FROM_TEMPERATURE`, where it was measured to win.
    """

    tree_budget: int | str | BudgetPolicy | None = None
    builder: str | TreeBuilder = "best_first"
    attention: Any = "auto"  # a backend name, None, or a TreeAttentionBackend object
    cpu_linear: bool | str = False
    threads: int | str | None = None
    prefill_chunk: int | None = PREFILL_CHUNK
    compile: bool | str = False
    coupled_drafts: bool | None = None
    prompt_lookup: bool | None = None  # None: the generator's default (DEFAULT_PROMPT_LOOKUP)
    numerics: str | None = None  # "fast", "exact", or None: the target device's default (default_numerics)

    def __post_init__(self) -> None:
        if self.tree_budget is not None:
            check_budget(self.tree_budget)
        resolve_builder(self.builder)
        check_attention(self.attention)
        check_cpu_linear(self.cpu_linear)
        check_threads(self.threads)
        check_prefill_chunk(self.prefill_chunk)
        check_compile(self)
        check_numerics(self.numerics)
        check_exact_settings(self)
        if self.prompt_lookup is not None and not isinstance(self.prompt_lookup, bool):
            raise ValueError(f"prompt_lookup must be True, False or None (the default), got {self.prompt_lookup!r}")
        if self.coupled_drafts is not None and not isinstance(self.coupled_drafts, bool):
            raise ValueError(f"coupled_drafts must be True, False or None (on from temperature "
                             f"{COUPLED_FROM_TEMPERATURE}), got {self.coupled_drafts!r}")

    def replace(self, **changes: Any) -> GeneratorOptions:
        """A checked copy with ``changes``; an unknown name is refused with the list of settings."""
        unknown = sorted(set(changes) - set(NAMES))
        if unknown:
            raise TypeError(f"unknown generator setting(s) {', '.join(unknown)}; the settings are "
                            f"{', '.join(NAMES)}")
        return dataclasses.replace(self, **changes)


NAMES = tuple(f.name for f in dataclasses.fields(GeneratorOptions))
"""Every generator setting, in declaration order."""


def check_attention(attention: Any) -> None:
    """A backend name (resolved now, so a typo or a missing package fails here), ``None``, or a backend object."""
    if attention is None or isinstance(attention, str):
        get_backend(attention)
    elif not hasattr(attention, "prepare") or not hasattr(attention, "tree_forward_kwargs"):
        raise TypeError(f"attention must be a backend name (e.g. 'auto', 'sdpa') or a tree-attention backend "
                        f"object with prepare and tree_forward_kwargs, got {type(attention).__name__}")


def check_compile(options: GeneratorOptions) -> None:
    """``compile``: ``False``, ``True`` (inductor; CUDA graphs on CUDA) or a ``torch.compile`` backend name; it
    runs the static round, which takes a fixed tree budget (0: plain decoding, compiled), or ``"auto"`` over a
    ladder of fixed ones, and the dense-mask attention."""
    value = options.compile
    if not (isinstance(value, bool) or (isinstance(value, str) and value)):
        raise ValueError(f"compile must be True, False or a torch.compile backend name, got {value!r}")
    if value is False:
        return
    budget = options.tree_budget
    adaptive = budget == "auto" or isinstance(budget, (AutoBudget, FixedBudget))
    if budget is not None and not adaptive and (isinstance(budget, bool) or not isinstance(budget, int)
                                                or budget < 0):
        raise ValueError(f"compile=True takes a fixed int tree_budget >= 0 (each tree size is its own compiled "
                         f"graph; 0 decodes plainly) or \"auto\" (a ladder of them), got {budget!r}; pass "
                         f"tree_budget=N or compile=False")
    if options.attention not in ("auto", "sdpa", None):
        raise ValueError(f"compile=True verifies with the dense tree mask (attention='sdpa'), got attention="
                         f"{options.attention!r}; leave attention='auto' or pass 'sdpa'")


def attention_name(attention: Any) -> Any:
    """An ``attention`` setting's name: the string itself, or a backend object's ``name`` (another generator's
    ``gen.backend``, passed to share it)."""
    return attention if attention is None or isinstance(attention, str) else getattr(attention, "name", attention)


def check_exact_settings(options: GeneratorOptions) -> None:
    """``numerics="exact"`` brings its own attention and linears (compiled, as one operator: the target is
    checked when the generator is built)."""
    if options.numerics != "exact":
        return
    if attention_name(options.attention) not in ("auto", None, "exact"):
        raise ValueError(f"numerics='exact' verifies with its own row-invariant attention, got attention="
                         f"{options.attention!r}; leave attention='auto'")


def check_cpu_linear(mode: Any) -> None:
    if not (isinstance(mode, bool) or mode == "auto"):
        raise ValueError(f"cpu_linear must be True, False or 'auto', got {mode!r}")


def check_threads(threads: Any) -> None:
    if threads is None or threads == "auto":
        return
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads must be 'auto', an int >= 1 or None (leave torch as it is), got {threads!r}")


def split_call_options(options: dict) -> dict:
    """Take this call's generator settings out of ``options`` (``generate``'s keywords) and return them.

    A per-model setting is refused with where to set it; ``tree_budget=None`` or ``builder=None`` means the
    generator's own (as if not given); ``prefill_chunk=None`` is a real value (the whole prompt at once).
    """
    for name in MODEL_SETTINGS:
        if name in options:
            raise ValueError(f"{name} prepares the models, so it is set on the generator, not per call: "
                             f"SpeculativeGenerator(target, drafter, {name}=...) (per call: {', '.join(PER_CALL)})")
    taken = {name: options.pop(name) for name in PER_CALL if name in options}
    return {k: v for k, v in taken.items() if v is not None or k == "prefill_chunk"}
