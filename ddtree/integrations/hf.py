"""ddtree inside ``transformers``: ``model.generate(..., custom_generate=ddtree.decoding(drafter))``.

``generate`` prepares everything as usual (generation config, logits processors,
stopping criteria, the streamer's prompt) and then calls the callable in place
of its decoding loop. :class:`DDTreeDecoding` runs ddtree's lossless loop
(:meth:`SpeculativeGenerator.stream`) and applies HF's stopping criteria token
by token, so max length, EOS and user criteria stop exactly where ``generate``
would. What it cannot reproduce exactly it refuses by name.
"""

from __future__ import annotations

import sys
import weakref
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

import torch

from ddtree.generation.inputs import StreamerFeed, prompt_rows
from ddtree.generation.options import GeneratorOptions, split_call_options

if TYPE_CHECKING:
    from ddtree.generation.generator import SpeculativeGenerator

# The only logits processors whose effect ddtree's sampler reproduces exactly.
_WARPERS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper")
_UNSET = object()  # a generator setting not given to this call
# model kwargs generate prepares that ddtree's own loop replaces.
_PREPARED = frozenset({"attention_mask", "position_ids", "cache", "past_key_values", "logits_to_keep", "use_cache"})


def decoding(drafter: Any, tree_budget: int | str | None = None, builder: Any = None, *, seed: int | None = None,
             options: GeneratorOptions | None = None, **settings: Any) -> DDTreeDecoding:
    """A ``custom_generate`` callable running DDTree with ``drafter``: a drafter directory or hub id (loaded
    against the target on first use, the class from its ``architectures``), a raw drafter model or any ``Drafter``.

    ``target.generate(**inputs, custom_generate=ddtree.decoding(drafter), max_new_tokens=128)``
    returns what ``generate`` returns. The generator's settings are those of :class:`SpeculativeGenerator`:
    ``options`` (a :class:`~ddtree.generation.options.GeneratorOptions`) and/or the same names as keywords
    (``tree_budget``, ``builder``, ``attention``, ...), checked here. ``tree_budget``, ``builder`` and
    ``prefill_chunk`` can also be given per call (``generate(..., tree_budget=8)``). Sampling is lossless
    with keyed draws (a pure function of the seed, the row and the position), not HF's sampler's, so for a
    seed the tokens differ from plain ``generate``'s but not between tree budgets: ``seed`` keys them;
    without it, one number drawn from torch's global RNG does, so ``torch.manual_seed`` repeats a call.
    """
    if options is not None and not isinstance(options, GeneratorOptions):
        raise TypeError(f"options must be a ddtree GeneratorOptions, got {type(options).__name__}")
    given = {k: v for k, v in (("tree_budget", tree_budget), ("builder", builder)) if v is not None}
    return DDTreeDecoding(drafter, (options or GeneratorOptions()).replace(**given, **settings), seed)


class DDTreeDecoding:
    """The callable behind :func:`decoding`; keeps one ``SpeculativeGenerator`` per target model."""

    def __init__(self, drafter: Any, options: GeneratorOptions, seed: int | None = None) -> None:
        self.drafter = drafter
        self.options = options
        self.seed = seed
        self._generators: weakref.WeakKeyDictionary[Any, SpeculativeGenerator] = weakref.WeakKeyDictionary()

    def generator_for(self, model: Any) -> SpeculativeGenerator:
        """The ``SpeculativeGenerator`` for ``model``, built on first use and reused."""
        from ddtree.generation.generator import SpeculativeGenerator

        gen = self._generators.get(model)
        if gen is None:
            gen = SpeculativeGenerator(model, self.drafter, options=self.options)
            self._generators[model] = gen
        return gen

    def __call__(self, model: Any, input_ids: torch.Tensor, logits_processor: Any = None,
                 stopping_criteria: Any = None, generation_config: Any = None, synced_gpus: bool = False,
                 streamer: Any = None, tree_budget: Any = None, builder: Any = None, prefill_chunk: Any = _UNSET,
                 attention: Any = _UNSET, cpu_linear: Any = _UNSET, threads: Any = _UNSET, **model_kwargs: Any) -> Any:
        """``generate``'s loop. The generator's settings are named here because ``generate`` hands a
        ``custom_generate`` callable only the keywords its signature names: ``tree_budget``, ``builder`` and
        ``prefill_chunk`` apply to this call; ``attention``, ``cpu_linear`` and ``threads`` are refused with
        where to set them."""
        if streamer is None:
            streamer = _streamer_of_caller(sys._getframe(1))
        given = dict(tree_budget=tree_budget, builder=builder, prefill_chunk=prefill_chunk, attention=attention,
                     cpu_linear=cpu_linear, threads=threads)
        feed = StreamerFeed(streamer) if streamer is not None else None  # generate has put the prompt already
        try:  # a refused call ends the streamer too, so a consumer thread never waits forever
            call = split_call_options({k: v for k, v in given.items() if v is not _UNSET})
            return self._decode(model, input_ids, logits_processor or [], stopping_criteria or [],
                                generation_config, synced_gpus, feed, call, model_kwargs)
        finally:
            if feed is not None:
                feed.end()

    def _decode(self, model: Any, input_ids: torch.Tensor, processors: Any, criteria: Any, cfg: Any,
                synced_gpus: bool, feed: StreamerFeed | None, call: dict, model_kwargs: dict) -> Any:
        if cfg is None:
            raise ValueError("ddtree.decoding is a custom_generate callable: call it through model.generate(...)")
        _refuse_unsupported(cfg, processors, input_ids, synced_gpus, model_kwargs)
        temperature, top_k, top_p = _sampling_from(cfg, processors)
        prompt = prompt_rows(input_ids, model_kwargs.get("attention_mask"))[0]
        room = (cfg.max_length - input_ids.shape[1]) if cfg.max_length is not None else None
        if room is None and not criteria:
            raise ValueError("generate set no max_length: pass max_new_tokens=N")
        gen = self.generator_for(model)
        seed = self.seed
        if seed is None:  # greedy leaves torch's global RNG alone, as plain generate does
            seed = int(torch.randint(0, 2**62, (1,)).item()) if temperature > 0 else 0
        limit = room if room is not None else getattr(model.config, "max_position_embeddings", 2**31) - len(prompt)
        ids = input_ids
        if limit > 0:
            chunks = gen.stream(prompt[None], max_new_tokens=limit, temperature=temperature, top_k=top_k, top_p=top_p,
                                stop_token_ids=(), seed=seed, **call)
            try:
                for (chunk,) in chunks:  # one row
                    ids, kept, stop = _apply_criteria(ids, chunk, criteria)
                    if feed is not None:
                        feed.put(chunk[:kept])
                    if stop:
                        break
            finally:
                chunks.close()
        if cfg.return_dict_in_generate:
            from transformers.generation.utils import GenerateDecoderOnlyOutput

            return GenerateDecoderOnlyOutput(sequences=cast(torch.LongTensor, ids))  # a long tensor
        return ids


def _apply_criteria(ids: torch.Tensor, chunk: list[int], criteria: Any) -> tuple[torch.Tensor, int, bool]:
    """Append ``chunk`` one token at a time, checking HF's criteria after each as ``_sample`` does.

    Returns the new ids, how many tokens of ``chunk`` were kept and whether a criterion fired.
    """
    for i, tok in enumerate(chunk):
        ids = torch.cat([ids, torch.tensor([[tok]], dtype=ids.dtype, device=ids.device)], dim=1)
        if len(criteria) and bool(criteria(ids, None).any()):
            return ids, i + 1, True
    return ids, len(chunk), False


def _streamer_of_caller(frame: FrameType | None) -> Any:
    """The ``streamer`` argument of the ``generate`` call that invoked us.

    transformers (5.0 to at least 5.24) calls a ``custom_generate`` callable
    without the streamer, after putting the prompt into it; reading it from
    ``generate``'s frame is the only way to send it the new tokens and ``end()``.
    """
    if frame is not None and frame.f_code.co_name == "generate":
        return frame.f_locals.get("streamer")
    return None


def _refuse_unsupported(cfg: Any, processors: Any, input_ids: torch.Tensor, synced_gpus: bool,
                        model_kwargs: dict) -> None:
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        why = (f" (num_beams={cfg.num_beams})" if (cfg.num_beams or 1) > 1 else
               f" (num_return_sequences={cfg.num_return_sequences})" if (cfg.num_return_sequences or 1) > 1 else "")
        raise ValueError(f"ddtree.decoding runs batch 1 for now, got input_ids of shape {tuple(input_ids.shape)}"
                         f"{why}: generate one prompt per call")
    if synced_gpus:
        raise ValueError("ddtree.decoding does not support synced_gpus (multi-GPU lockstep): pass synced_gpus=False")
    for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if getattr(cfg, name, None) and cfg.return_dict_in_generate:
            raise ValueError(f"ddtree.decoding cannot return {name.removeprefix('output_')} (it verifies trees, "
                             f"not one token per forward): drop {name}=True")
    extra = sorted(k for k, v in model_kwargs.items() if k not in _PREPARED and v is not None)
    if extra:
        raise ValueError(f"ddtree.decoding cannot pass model inputs {', '.join(extra)} to its forwards; it takes "
                         "input_ids (and attention_mask) only")
    for key in ("cache", "past_key_values"):
        cache = model_kwargs.get(key)
        if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
            raise ValueError("ddtree.decoding starts from the prompt and keeps its own cache: do not pass a filled "
                             f"{key}")
    names = [type(p).__name__ for p in processors]
    for p in processors:
        name = type(p).__name__
        if name not in _WARPERS:
            raise ValueError(
                f"ddtree.decoding cannot honour {name} exactly (only temperature, top_k and top_p are reproduced "
                "by its lossless verifier): remove the option that adds it (e.g. repetition_penalty, "
                "no_repeat_ngram_size, min_new_tokens, suppress_tokens, typical_p, min_p) or the logits_processor"
            )
        if getattr(p, "min_tokens_to_keep", 1) != 1:
            raise ValueError(f"{name} with min_tokens_to_keep={p.min_tokens_to_keep} is not supported (ddtree keeps 1)")
    if names != sorted(names, key=_WARPERS.index) or len(set(names)) != len(names):
        raise ValueError(f"ddtree.decoding applies temperature, then top-k, then top-p, once each (as generate "
                         f"builds them); these logits processors come as {names}")


def _sampling_from(cfg: Any, processors: Any) -> tuple[float, int | None, float | None]:
    """Greedy unless ``do_sample``; then the warpers' own values (what ``_sample`` applies)."""
    if not cfg.do_sample:
        return 0.0, None, None  # argmax is unchanged by temperature, top-k and top-p
    temperature, top_k, top_p = 1.0, None, None
    for p in processors:
        name = type(p).__name__
        if name == "TemperatureLogitsWarper":
            temperature = float(p.temperature)
        elif name == "TopKLogitsWarper":
            top_k = int(p.top_k)
        elif name == "TopPLogitsWarper":
            top_p = float(p.top_p)
    return temperature, top_k, top_p
