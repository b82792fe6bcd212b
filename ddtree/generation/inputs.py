"""What a Hugging Face user hands to ``generate``, turned into what ddtree's loop needs.

Two pure functions and a streamer feed, so that ``SpeculativeGenerator`` (and
anything else) can take the inputs a ``transformers`` user already has:

- :func:`prompt_rows`: a tensor, lists of ids, a tokenizer's ``BatchEncoding``
  (its left padding removed) or strings, as one unpadded 1-D id tensor per row;
- :func:`resolve_generation`: a ``GenerationConfig`` or the keyword names of
  ``generate`` (``do_sample``, ``temperature``, ...) as :class:`GenerationSettings`,
  refusing by name every option ddtree cannot honour exactly;
- :class:`StreamerFeed` / :func:`streamed`: any transformers streamer
  (``TextStreamer``, ``TextIteratorStreamer``) fed the prompt, then each round's tokens.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ddtree.core.noise import check_seed
from ddtree.core.sampling import SamplingConfig

ACCEPTED_PROMPTS = (
    "a [T] or [B, T] integer tensor, a list of ints, a list of lists of ints, a list of 1-D tensors, "
    "a tokenizer's BatchEncoding or dict with 'input_ids' (and optionally 'attention_mask'), "
    "or a string / list of strings when a tokenizer is available"
)


# --------------------------------------------------------------------- prompts


def prompt_rows(
    inputs: Any,
    attention_mask: Any = None,
    tokenizer: Any = None,
    *,
    vocab_size: int | None = None,
) -> list[torch.Tensor]:
    """One unpadded 1-D ``long`` tensor per prompt, from any form a HF user holds.

    A ``BatchEncoding`` / dict brings its own ``attention_mask`` (an explicit
    ``attention_mask`` argument wins). Masked positions must be LEFT padding
    (zeros, then ones), which is what a decoder-only batch uses; they are dropped
    per row. Strings need ``tokenizer`` (called as ``tokenizer(text)``, so its
    special-token rules apply). ``vocab_size`` rejects ids outside ``[0, vocab_size)``.
    """
    if isinstance(inputs, Mapping) or _is_batch_encoding(inputs):
        if "input_ids" not in inputs:
            keys = ", ".join(map(str, inputs.keys())) or "none"
            raise ValueError(f"the prompt dict has no 'input_ids' (keys: {keys}); give {ACCEPTED_PROMPTS}")
        if attention_mask is None:
            attention_mask = inputs.get("attention_mask")
        inputs = inputs["input_ids"]
    if isinstance(inputs, str) or (isinstance(inputs, (list, tuple)) and inputs and
                                   all(isinstance(x, str) for x in inputs)):
        if tokenizer is None:
            raise ValueError(
                "a text prompt needs a tokenizer: load with SpeculativeGenerator.from_pretrained(...) (which "
                "loads the target's tokenizer) or pass token ids, e.g. tokenizer(text, return_tensors='pt')"
            )
        texts = [inputs] if isinstance(inputs, str) else list(inputs)
        rows = [torch.as_tensor(tokenizer(t)["input_ids"], dtype=torch.long).view(-1) for t in texts]
        if attention_mask is not None:
            raise ValueError("attention_mask goes with token ids, not with text prompts: drop it")
    else:
        rows = _id_rows(inputs)
        if attention_mask is not None:
            rows = _unpad(rows, attention_mask)
    for i, row in enumerate(rows):
        if row.numel() == 0:
            where = f"row {i} of the prompt" if len(rows) > 1 else "the prompt"
            raise ValueError(f"{where} is empty: give at least one token (e.g. the BOS token)")
        if vocab_size is not None:
            bad = row[(row < 0) | (row >= vocab_size)]
            if bad.numel():
                raise ValueError(
                    f"token id {int(bad[0])} in row {i} is outside the vocabulary [0, {vocab_size}): "
                    "were these ids made by another model's tokenizer?"
                )
    return rows


def _is_batch_encoding(x: Any) -> bool:
    return type(x).__name__ == "BatchEncoding" and hasattr(x, "keys")


def _refuse(got: Any) -> ValueError:
    return ValueError(f"cannot read a prompt from {_describe(got)}: give {ACCEPTED_PROMPTS}")


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    if isinstance(x, (list, tuple)) and x:
        return f"a {type(x).__name__} of {type(x[0]).__name__}"
    return f"{type(x).__name__} {x!r}"[:120]


def _as_int_tensor(x: Any, got: Any) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else None
    if t is None:
        try:
            t = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError):
            raise _refuse(got) from None
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise _refuse(got)
    return t.long()


def _id_rows(inputs: Any) -> list[torch.Tensor]:
    if isinstance(inputs, torch.Tensor) or hasattr(inputs, "__array__") and not isinstance(inputs, (list, tuple)):
        t = _as_int_tensor(inputs, inputs)
        if t.dim() == 1:
            return [t]
        if t.dim() == 2:
            if t.shape[0] == 0:
                raise ValueError(f"the prompt batch is empty (shape {tuple(t.shape)}): give at least one row")
            return list(t.unbind(0))
        raise _refuse(inputs)
    if isinstance(inputs, (list, tuple)):
        if not inputs:
            raise ValueError(f"the prompt is empty: give at least one token; accepted: {ACCEPTED_PROMPTS}")
        if all(isinstance(x, int) and not isinstance(x, bool) for x in inputs):
            return [torch.tensor(list(inputs), dtype=torch.long)]
        rows = []
        for x in inputs:
            if isinstance(x, torch.Tensor) and x.dim() == 1 or isinstance(x, (list, tuple)):
                if isinstance(x, (list, tuple)) and not all(isinstance(v, int) and not isinstance(v, bool) for v in x):
                    raise _refuse(inputs)
                rows.append(_as_int_tensor(x, inputs).view(-1) if len(x) else torch.zeros(0, dtype=torch.long))
            else:
                raise _refuse(inputs)
        return rows
    raise _refuse(inputs)


def _unpad(rows: list[torch.Tensor], attention_mask: Any) -> list[torch.Tensor]:
    masks = _id_rows(attention_mask) if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 1 \
        else [attention_mask.long()]
    if len(masks) != len(rows) or any(m.shape != r.shape for m, r in zip(masks, rows)):
        raise ValueError(
            f"attention_mask shapes {[tuple(m.shape) for m in masks]} do not match the prompt rows "
            f"{[tuple(r.shape) for r in rows]}"
        )
    out = []
    for i, (row, mask) in enumerate(zip(rows, masks)):
        if ((mask != 0) & (mask != 1)).any():
            raise ValueError(f"attention_mask row {i} holds values other than 0 and 1")
        first = int(mask.argmax()) if mask.any() else mask.numel()
        if not bool(mask[first:].all()):
            raise ValueError(
                f"attention_mask row {i} is not left padding (zeros, then ones): {mask.tolist()[:32]}. "
                "Decoder-only prompts are padded on the left: set tokenizer.padding_side = 'left', "
                "or pass the rows unpadded as a list of lists"
            )
        out.append(row[first:].to(device=row.device))
    return out


# --------------------------------------------------------------------- generation options


@dataclass(frozen=True)
class GenerationSettings:
    """What one ``generate`` call decodes with; ``temperature == 0`` is greedy."""

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    stop_token_ids: tuple[int, ...] = ()
    seed: int | tuple[int, ...] | None = None  # one for the batch, or one per prompt

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()

# GenerationConfig fields that never change which tokens a batch-1 sampler emits.
_INERT = frozenset({
    "pad_token_id", "bos_token_id", "decoder_start_token_id", "use_cache", "cache_implementation", "cache_config",
    "max_cache_len", "compile_config", "disable_compile", "transformers_version", "_from_model_config",
    "early_stopping", "length_penalty", "num_assistant_tokens", "num_assistant_tokens_schedule",
    "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind", "return_dict_in_generate",
    "low_memory", "prefill_chunk_size", "is_assistant", "continuous_batching_config", "token_healing",
    "_commit_hash", "_original_object_hash",
})
_HANDLED = frozenset({"do_sample", "temperature", "top_k", "top_p", "max_new_tokens", "max_length", "eos_token_id"})


def _hf_defaults() -> dict:
    from transformers import GenerationConfig

    return dict(GenerationConfig._get_default_generation_params())


def resolve_generation(
    generation_config: Any = None,
    *,
    target_generation_config: Any = None,
    max_new_tokens: int | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = UNSET,
    stop_token_ids: int | Sequence[int] | None = UNSET,
    seed: int | Sequence[int] | None = None,
    prompt_length: int | None = None,
    other_names: Sequence[str] = (),
    **options: Any,
) -> GenerationSettings:
    """Resolve ``generate``-style options into :class:`GenerationSettings`, exactly or not at all.

    Two modes, so that ddtree's own calls keep their meaning:

    - **HF rules**, as soon as ``do_sample`` or a ``GenerationConfig`` is given
      (what ``transformers`` ``generate`` does): each option comes from the
      keyword, else ``generation_config``, else ``target_generation_config``,
      else HF's global defaults (``do_sample=False``, ``temperature=1.0``,
      ``top_k=50``, ``top_p=1.0``). ``do_sample=False`` is greedy whatever the
      temperature; the sampling filters (including the default ``top_k=50``)
      apply only when ``do_sample`` is true; ``top_k=0`` and ``top_p=1.0`` mean
      no filter; ``do_sample=True`` with ``temperature=0`` is refused, as HF does.
    - **ddtree's rule** otherwise: ``temperature`` 0 (the default) is greedy and
      ``temperature > 0`` samples the unfiltered distribution, filtered only by
      the ``top_k`` / ``top_p`` given here. The target's generation config then
      contributes only its ``eos_token_id``.

    Stop tokens: ``stop_token_ids`` (or its HF name ``eos_token_id``) if given,
    else the ``GenerationConfig``'s, else the target's ``eos_token_id`` (all of
    them when it is a list). ``stop_token_ids=()`` turns stopping off.
    ``max_new_tokens`` may come from a config; a config's ``max_length`` counts
    the prompt, so it needs ``prompt_length``. Any other option (``num_beams``,
    ``repetition_penalty``, ``min_new_tokens``, ``typical_p``, ...) that is not
    at HF's default changes the output distribution and is refused by name; an unknown name is refused
    with every accepted name, ``other_names`` (what the caller takes besides these) included.
    """
    hf_mode = do_sample is not None or generation_config is not None
    defaults = _hf_defaults()
    given = {k: v for k, v in dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                                   max_new_tokens=max_new_tokens).items() if v is not None}
    layers: list[dict] = [given, options]
    if generation_config is not None:
        layers.append(_config_dict(generation_config))
    if hf_mode and target_generation_config is not None:
        layers.append(_config_dict(target_generation_config))

    def value(name: str, fallback: Any = None) -> Any:
        for layer in layers:
            if layer.get(name) is not None:
                return layer[name]
        return defaults.get(name, fallback)

    _refuse_options(options, layers if hf_mode else [options], defaults, other_names)

    if hf_mode:
        sample = bool(value("do_sample"))
        if sample:
            temp = _number("temperature", value("temperature"))
            if temp <= 0:
                raise ValueError(f"do_sample=True needs temperature > 0 (got {temp}); for greedy decoding pass "
                                 "do_sample=False")
            k = _whole("top_k", value("top_k"))
            p = _number("top_p", value("top_p"))
            settings_k = k if k not in (None, 0) else None
            settings_p = p if p is not None and p < 1.0 else None
        else:
            temp, settings_k, settings_p = 0.0, None, None
    else:
        temp = _number("temperature", temperature or 0.0)
        settings_k, settings_p = _whole("top_k", top_k), _number("top_p", top_p)
    SamplingConfig(temp, settings_k, settings_p)  # validates ranges with its own messages

    new = value("max_new_tokens")
    if new is None:
        limit = options.get("max_length")
        if limit is None and generation_config is not None:
            limit = _config_dict(generation_config).get("max_length")
        if limit is not None and prompt_length is not None:
            new = limit - prompt_length
        else:
            raise ValueError("pass max_new_tokens=N (how many tokens to generate after the prompt)")
    if not isinstance(new, int) or isinstance(new, bool) or new < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {new!r}")

    stops = _resolve_stops(eos_token_id, stop_token_ids, generation_config, target_generation_config)
    return GenerationSettings(new, temp, settings_k, settings_p, stops, _checked_seed(seed))


_NUMBERS = {"temperature": "a number >= 0 (0: greedy), e.g. temperature=0.7",
            "top_p": "a number in (0, 1] (1: no filter), e.g. top_p=0.9", "top_k": "a positive int (None: no filter)"}


def _number(name: str, value: Any) -> Any:
    """``value`` as a float, ``None`` kept; anything that is not a finite real number is refused by ``name``
    (``float("hot")``'s own message names no parameter)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be {_NUMBERS[name]}; got {value!r}")
    return float(value)


def _whole(name: str, value: Any) -> Any:
    """``value`` as an int, ``None`` kept; a float with no fraction is taken (a config may hold 50.0)."""
    if value is None:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) \
            and float(value).is_integer():
        return int(float(value))
    raise ValueError(f"{name} must be {_NUMBERS[name]}; got {value!r}")


def _checked_seed(seed: Any) -> int | tuple[int, ...] | None:
    """``seed`` as an int in ``[0, 2**64)``, a tuple of such ints (one per prompt) or None; anything else is
    refused (a seed out of range would draw another seed's tokens: :func:`~ddtree.core.noise.check_seed`)."""
    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if seed is None:
        return seed
    if is_int(seed):
        return check_seed(seed)
    if isinstance(seed, Sequence) and not isinstance(seed, str) and seed and all(is_int(s) for s in seed):
        return tuple(check_seed(s) for s in seed)
    raise ValueError(f"seed must be an int in [0, 2**64) (keys every row by (seed, row)) or a list of such ints, "
                     f"one per prompt; got {seed!r}")


def _config_dict(cfg: Any) -> dict:
    if isinstance(cfg, Mapping):
        return dict(cfg)
    if hasattr(cfg, "to_dict"):
        return {k: v for k, v in cfg.to_dict().items() if not k.startswith("_") or k == "_from_model_config"}
    raise TypeError(f"generation_config must be a transformers GenerationConfig or a dict, got {type(cfg).__name__}")


ACCEPTED_OPTIONS = ("max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "eos_token_id",
                    "stop_token_ids", "seed")
"""The generation options :func:`resolve_generation` honours (other GenerationConfig names only at HF's default)."""


def _refuse_options(options: dict, layers: list[dict], defaults: dict, other_names: Sequence[str] = ()) -> None:
    """Refuse unknown names, and known options whose effective value (first layer that sets it) is not HF's default."""
    from transformers import GenerationConfig

    known = set(GenerationConfig().to_dict()) | set(defaults)
    unknown = sorted(k for k in options if k not in known)
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; accepted: "
                        f"{', '.join(dict.fromkeys([*ACCEPTED_OPTIONS, *other_names]))} (any other name of "
                        "transformers' GenerationConfig is accepted at its default value only)")
    names = {n for layer in layers for n in layer if n in known and n not in _HANDLED and n not in _INERT}
    for name in sorted(names):
        v = next((layer[name] for layer in layers if layer.get(name) is not None), None)
        if v is None or v == defaults.get(name) or (name.startswith("output_") and not v):
            continue
        fix = (f"pass {name}={defaults[name]!r} to override it" if defaults.get(name) is not None
               else f"clear it (e.g. model.generation_config.{name} = None)")
        raise ValueError(
            f"{name}={v!r} cannot be honoured exactly by ddtree's lossless decoding "
            f"(it supports do_sample, temperature, top_k, top_p, max_new_tokens and eos_token_id); {fix}"
        )


def _ids(x: Any) -> tuple[int, ...]:
    if x is None:
        return ()
    if isinstance(x, torch.Tensor):
        return tuple(int(v) for v in x.view(-1).tolist())
    if isinstance(x, int):
        return (int(x),)
    return tuple(int(v) for v in x)


def _resolve_stops(eos_token_id: Any, stop_token_ids: Any, generation_config: Any,
                   target_generation_config: Any) -> tuple[int, ...]:
    if stop_token_ids is not UNSET and eos_token_id is not UNSET and _ids(stop_token_ids) != _ids(eos_token_id):
        raise ValueError("give stop_token_ids or eos_token_id, not both (they are the same thing)")
    for explicit in (stop_token_ids, eos_token_id):
        if explicit is not UNSET and explicit is not None:
            return _ids(explicit)
    for cfg in (generation_config, target_generation_config):
        if cfg is not None:
            eos = cfg.get("eos_token_id") if isinstance(cfg, Mapping) else getattr(cfg, "eos_token_id", None)
            if eos is not None:
                return _ids(eos)
    return ()


# --------------------------------------------------------------------- what the target can do


def check_limits(settings: GenerationSettings, prompt_lengths: Sequence[int], *, vocab_size: int | None,
                 max_positions: int | None) -> None:
    """Refuse, before any state exists, settings the target cannot honour: :func:`check_stop_ids` and
    :func:`check_room`."""
    check_stop_ids(settings.stop_token_ids, vocab_size)
    check_room(prompt_lengths, settings.max_new_tokens, max_positions)


def check_stop_ids(stop_ids: Iterable[int], vocab_size: int | None) -> None:
    """A stop id outside ``[0, vocab_size)`` can never be emitted, so it would stop nothing: refused."""
    if vocab_size is None:
        return
    for token in stop_ids:
        if not 0 <= token < vocab_size:
            raise ValueError(f"stop token id {token} is outside the target's vocabulary [0, {vocab_size}), so it "
                             "would never stop generation: pass ids of this target's tokenizer (e.g. "
                             "tokenizer.eos_token_id), or stop_token_ids=() to stop only at max_new_tokens")


def check_room(prompt_lengths: Sequence[int], max_new_tokens: int, max_positions: int | None) -> None:
    """The longest prompt plus ``max_new_tokens`` must fit in the target's ``max_position_embeddings``: past it a
    model runs on positions it never learned (or has no embedding for)."""
    if max_positions is None or not prompt_lengths:
        return
    longest = max(prompt_lengths)
    if longest + max_new_tokens <= max_positions:
        return
    where = "the prompt" if len(prompt_lengths) == 1 else \
        f"the longest prompt (row {list(prompt_lengths).index(longest)})"
    fix = (f"lower max_new_tokens to {max_positions - longest} or shorten the prompt" if longest < max_positions
           else "shorten the prompt")
    raise ValueError(f"{where} has {longest} tokens and max_new_tokens is {max_new_tokens}: {longest + max_new_tokens} "
                     f"positions, more than the target's max_position_embeddings ({max_positions}); {fix}")


# --------------------------------------------------------------------- chat templates

_SENTINEL = "DDTREE-CONTENT-7f3a"


def missing_chat_template(tokenizer: Any, prompt: Sequence[int] | torch.Tensor) -> bool:
    """True when ``tokenizer`` has a chat template and ``prompt`` does not end with its assistant turn opener
    (what ``apply_chat_template(..., add_generation_prompt=True)`` puts after the user's text)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return False
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                                 add_generation_prompt=True)
        text = tokenizer.decode(torch.as_tensor(prompt).view(-1).tolist(), skip_special_tokens=False)
    except Exception:  # a template that needs other inputs, a tokenizer without decode: no opinion
        return False
    if not isinstance(rendered, str) or _SENTINEL not in rendered:
        return False
    opener = rendered.split(_SENTINEL)[-1].strip()
    return bool(opener) and not text.rstrip().endswith(opener)


def chat_template_warning(tokenizer: Any, prompts: Sequence[Sequence[int] | torch.Tensor], new_tokens: list[list[int]],
                          stops: Collection[int]) -> str | None:
    """The hint for a generation whose rows stopped at their first token on a prompt without the chat
    template (an instruct model given raw text often ends at once); ``None`` when it does not apply."""
    rows = [b for b, new in enumerate(new_tokens) if len(new) == 1 and new[0] in stops]
    if not rows or not any(missing_chat_template(tokenizer, prompts[b]) for b in rows):
        return None
    where = "the generation" if len(new_tokens) == 1 else f"row(s) {rows} of the batch"
    return (f"{where} stopped at its first token (stop token {new_tokens[rows[0]][0]}), and the prompt does not "
            "end with the chat template's assistant turn: an instruct model given raw text often ends at once. "
            "Format the prompt with tokenizer.apply_chat_template([{'role': 'user', 'content': text}], "
            "add_generation_prompt=True, return_dict=True, return_tensors='pt') and pass **inputs")


# --------------------------------------------------------------------- streamers


class StreamerFeed:
    """Feeds a transformers streamer (``put(tensor)`` / ``end()``) as rounds commit.

    The prompt goes first (``[1, T]``, as ``generate`` does, so ``skip_prompt``
    works), then each round's tokens as one 1-D tensor; ``end()`` runs once,
    also when the loop stops early or fails, so a ``TextIteratorStreamer``
    consumer never waits forever.
    """

    def __init__(self, streamer: Any, prompt: torch.Tensor | Sequence[int] | None = None) -> None:
        self.streamer = streamer
        self._ended = False
        if prompt is not None:
            ids = torch.as_tensor(prompt, dtype=torch.long).cpu()
            streamer.put(ids.view(1, -1))

    def put(self, tokens: Sequence[int] | torch.Tensor) -> None:
        ids = torch.as_tensor(tokens, dtype=torch.long).view(-1).cpu()
        if ids.numel():
            self.streamer.put(ids)

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self.streamer.end()

    def __enter__(self) -> StreamerFeed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()


def _is_id(x: Any) -> bool:
    return isinstance(x, int) or isinstance(x, torch.Tensor) and x.dim() == 0


def streamed(chunks: Iterable[Sequence], streamer: Any,
             prompt: torch.Tensor | Sequence[int] | None = None) -> Iterator[list]:
    """Pass ``chunks`` through, feeding ``streamer`` on the way.

    A chunk is what ``SpeculativeGenerator.stream(...)`` yields for one prompt (``[ids]``, one list per row) or
    a flat list of ids (a loop of your own); a transformers streamer takes one sequence, so a chunk of more
    than one row is refused.
    """
    with StreamerFeed(streamer, prompt) as feed:
        for chunk in chunks:
            chunk = list(chunk)
            rows = [list(r) for r in chunk if not _is_id(r)]
            if rows and len(rows) != len(chunk):
                raise ValueError(f"a stream chunk mixes ids and rows: {chunk!r:.80}")
            if len(rows) > 1:
                raise ValueError("transformers streamers take one sequence: stream a batch with stream(), which "
                                 "yields each row's tokens per round, and feed each row its own streamer")
            feed.put(rows[0] if rows else chunk)
            yield chunk
