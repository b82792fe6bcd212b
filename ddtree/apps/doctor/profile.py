"""Acceptance profiles with vLLM's definitions, from ddtree's per-round accepted counts.

mean = 1 + accepted / drafts; rate at position k = drafts whose first k draft
tokens were all accepted / drafts (so ``mean == 1 + sum(rates)``). A "draft" is
one verify round of one prompt; the prefill round verifies nothing and is left out.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

BUILTIN_PROMPTS = ["chat-1", "code-1", "math-1", "story-1", "chat-4", "code-2", "math-2", "story-2"]


@dataclass
class Paired:
    """A fault against the correct integration at the same rounds: the same contexts, the same true tokens.

    ``gap``: mean accepted tokens per round lost to the fault (correct minus faulty), ``se`` its standard
    error over the rounds, ``changed``: the share of rounds whose chain draft differs from the correct one.
    Pairing removes the prompt-to-prompt noise, so a small loss shows where free-running profiles cannot.

    ``nats``/``nats_se``: the mean log-probability per chain position that the fault takes from the target's
    own next tokens (floored at :data:`LOGPROB_FLOOR`). Every position of every round counts, not only the
    first miss, so it shows a fault that degrades the drafter even where this drafter's acceptance, mostly
    decided at position 1, hardly moves.
    """

    rounds: int
    gap: float
    se: float
    changed: float
    nats: float = 0.0
    nats_se: float = 0.0

    @property
    def z(self) -> float:
        return _z(self.gap, self.se)

    @property
    def nats_z(self) -> float:
        return _z(self.nats, self.nats_se)


def _z(mean: float, se: float) -> float:
    if se == 0:
        return 0.0 if mean == 0 else math.copysign(math.inf, mean)
    return mean / se


LOGPROB_FLOOR = -20.0
"""Log-probabilities of the target's tokens are floored here (nats), so a token outside a draft vocabulary
(``-inf``) counts as a very bad guess, not as an infinite loss."""


@dataclass
class Replay:
    """A drafter's chain at a run's rounds: per round the draft tokens accepted, the chain draft, and the mean
    (floored) log-probability it gave the target's true next tokens."""

    counts: list[int]
    drafts: list[torch.Tensor]
    logprobs: list[float]


@dataclass
class Profile:
    """One configuration's acceptance on the prompts. ``skipped``: why it did not run (then no figures)."""

    name: str
    title: str
    method: str = "chain"  # "chain" or "tree@B"
    mean: float | None = None
    per_position: list[float] = field(default_factory=list)
    drafts: int = 0
    accepted: int = 0
    skipped: str | None = None
    check: str = ""
    seconds: float = 0.0  # wall time of its runs (for the report only)
    paired: Paired | None = None  # replayed at the correct integration's rounds (see :func:`replay_counts`)


def profile_from_counts(name: str, title: str, accepted: Sequence[int], positions: int, method: str = "chain",
                        check: str = "") -> Profile:
    """The profile of per-draft accepted counts (draft tokens accepted, bonus excluded)."""
    acc = [int(a) for a in accepted]
    drafts = len(acc)
    if drafts == 0:
        return Profile(name, title, method, skipped="no draft rounds ran (prompts too short or max tokens 1)",
                       check=check)
    rates = [sum(a >= k for a in acc) / drafts for k in range(1, positions + 1)]
    return Profile(name, title, method, 1 + sum(acc) / drafts, rates, drafts, sum(acc), check=check)


RUN_BATCH = 8  # prompts generated as one batch in :func:`accepted_counts`


def accepted_counts(generator, prompts: Sequence[torch.Tensor], budget: int, max_new_tokens: int,
                    step: Callable[[int], None] | None = None, runs: list | None = None,
                    batch: int = RUN_BATCH) -> list[int]:
    """Per verify round, the draft tokens accepted (``acceptance - 1``), over every prompt, greedy.

    Up to ``batch`` prompts run as one batch (each row is decided as it would be alone; the batch only
    shares the forwards). ``runs``, when given, receives ``(sequence [1, P + N], prompt length, that prompt's
    counts)`` per prompt, for :func:`replay_counts`; ``step(n)`` is told of each ``n`` prompts done.
    """
    counts: list[int] = []
    for i in range(0, len(prompts), max(1, batch)):
        group = prompts[i:i + max(1, batch)]
        rows = [p.view(-1) for p in group]
        out = generator.generate(rows if len(rows) > 1 else rows[0].view(1, -1), max_new_tokens=max_new_tokens,
                                 tree_budget=budget, temperature=0.0)
        for r, ids in enumerate(rows):
            mine = [int(a) - 1 for a in out.row_acceptance[r]]
            counts.extend(mine)
            if runs is not None:
                new = torch.tensor(out.row_tokens[r], dtype=ids.dtype)
                runs.append((torch.cat([ids.cpu(), new]).view(1, -1), int(ids.numel()), mine))
        if step is not None:
            step(len(rows))
    return counts


REPLAY_BATCH = 8  # runs replayed side by side (one drafter forward proposes for all of them)


@torch.no_grad()
def replay_counts(target, drafter, runs: Sequence[tuple[torch.Tensor, int, list[int]]],
                  hidden: Sequence | None = None, own_tokens: bool = False) -> Replay:
    """A drafter's chain at another run's rounds: per round, the draft tokens it would get accepted, its draft,
    and the log-probability it gives the true tokens.

    Each run is ``(sequence, prompt length, accepted counts)`` from :func:`accepted_counts` (greedy, so every
    correct drafter yields the same sequence). One target forward per run gives every position's features;
    the drafter then gets the context that run had at each round start, drafts a chain from that round's
    root, and is scored against the true next tokens. Replaying the run's own drafter gives back its counts.
    Up to :data:`REPLAY_BATCH` runs share each proposal (a ragged batch: a run past its last round appends
    nothing), which a weight-bound drafter on a CPU does in little more than one run's time. ``hidden``:
    each run's target hidden states (:func:`target_hidden_states`) when they are already known, since
    a fault that leaves the target alone reads the same ones.

    ``own_tokens``: score against ``target``'s own greedy next token at each position of the run (one
    forward over it, so each given the run's tokens before it) instead of the run's tokens. A fault that
    changes the target (its precision) is then judged by how well the drafter follows that target, as an
    engine running it would be, on the same contexts. Past a draft's first position this is the target's
    choice after the run's own tokens, not after the draft's, which differ where the two targets part.
    """
    if own_tokens and hidden is not None:
        raise ValueError("own_tokens needs the target's own forward: give no hidden states with it")
    out = Replay([], [], [])
    for i in range(0, len(runs), REPLAY_BATCH):
        known = None if hidden is None else hidden[i:i + REPLAY_BATCH]
        for part in _replay_batch(target, drafter, runs[i:i + REPLAY_BATCH], known, own_tokens):
            out.counts += part.counts
            out.drafts += part.drafts
            out.logprobs += part.logprobs
    return out


@torch.no_grad()
def target_hidden_states(target, runs, layers: Sequence[int] | None = None, predictions: list | None = None
                         ) -> list[tuple]:
    """Per run, the target's hidden states over its sequence (HF's layout; only ``layers`` kept when given).
    ``predictions``, when given, receives per run the target's greedy next token at every position ``[1, L]``
    (position 0 keeps the run's first token): what it would append after each prefix."""
    from ddtree.targets.cache import new_target_cache
    from ddtree.targets.forward import target_forward

    device = target.get_input_embeddings().weight.device
    out = []
    for seq, _, _ in runs:
        seq = seq.to(device)
        res = target_forward(target, seq, None, new_target_cache(target), hidden=True,
                             last=None if predictions is not None else 1,
                             layers=None if layers is None else list(layers))
        if predictions is not None:
            predictions.append(torch.cat([seq[:, :1], res.logits[:, :-1].argmax(-1)], dim=1))
        out.append(res.hidden_states)
    return out


def _replay_batch(target, drafter, runs, hidden=None, own_tokens=False) -> list[Replay]:
    device = target.get_input_embeddings().weight.device
    seqs = [seq.to(device) for seq, _, _ in runs]
    truths = [] if own_tokens else None
    if hidden is None:  # each run's features read right after its forward: a fault's hooks keep only the last
        layers = getattr(drafter, "target_layer_ids", None)
        features = [drafter.context_features(target_hidden_states(target, [run], layers, truths)[0])
                    for run in runs]
    else:
        features = [drafter.context_features(h) for h in hidden]
    truths = seqs if truths is None else truths
    n = len(runs)
    ctx = drafter.new_context(n)

    def append(spans):  # spans[r] = (start, end) of run r's tokens to append, empty for none
        width = max(e - a for a, e in spans)
        f = features[0].new_zeros((n, width, features[0].shape[-1]))
        t = torch.zeros((n, width), dtype=torch.long, device=device)
        for r, (a, e) in enumerate(spans):
            f[r, : e - a], t[r, : e - a] = features[r][0, a:e], seqs[r][0, a:e]
        counts = torch.tensor([e - a for a, e in spans], device=device)
        ctx.append(f, t, None if bool((counts == width).all()) else counts)

    append([(0, plen) for _, plen, _ in runs])
    at = [plen for _, plen, _ in runs]
    out = [Replay([], [], []) for _ in runs]
    for j in range(max(len(rounds) for _, _, rounds in runs)):
        live = [j < len(rounds) and at[r] < seqs[r].shape[1] for r, (_, _, rounds) in enumerate(runs)]
        if not any(live):
            break
        roots = torch.stack([seqs[r][0, min(at[r], seqs[r].shape[1] - 1)] for r in range(n)])[:, None]
        blocks = ctx.propose(roots).logprobs
        spans = []
        for r, (_, _, rounds) in enumerate(runs):
            if not live[r]:
                spans.append((at[r], at[r]))
                continue
            end = seqs[r].shape[1]
            draft = blocks[r].argmax(-1)
            truth = truths[r][0, at[r] + 1:at[r] + 1 + draft.numel()]
            same = (draft[:truth.numel()] == truth).int().cumprod(0)
            out[r].counts.append(int(same.sum()))
            out[r].drafts.append(draft.cpu())
            given = blocks[r, : truth.numel()].gather(-1, truth[:, None]).clamp(min=LOGPROB_FLOOR)
            out[r].logprobs.append(float(given.mean()) if truth.numel() else 0.0)
            step = min(rounds[j] + 1, end - at[r])
            spans.append((at[r], at[r] + step))
            at[r] += step
        if any(e > a for a, e in spans):
            append(spans)
    return out


def paired(reference: Replay, fault: Replay) -> Paired:
    """The paired comparison of two replays over the same rounds."""
    n = min(len(reference.counts), len(fault.counts))
    if n == 0:
        return Paired(0, 0.0, 0.0, 0.0)
    gap, se = _mean_se([reference.counts[i] - fault.counts[i] for i in range(n)])
    nats, nats_se = _mean_se([reference.logprobs[i] - fault.logprobs[i] for i in range(n)])
    changed = sum(not torch.equal(reference.drafts[i], fault.drafts[i]) for i in range(n)) / n
    return Paired(n, gap, se, changed, nats, nats_se)


def _mean_se(values: Sequence[float]) -> tuple[float, float]:
    d = torch.tensor(values, dtype=torch.float64)
    se = float(d.std(unbiased=True) / math.sqrt(len(values))) if len(values) > 1 else 0.0
    return float(d.mean()), se


def noise(profile: Profile) -> float:
    """The RMS standard error of a profile's per-position rates (binomial, over its drafts): how far two
    measurements of the same integration on these prompts can drift apart by chance."""
    if not profile.drafts or not profile.per_position:
        return 0.0
    var = [p * (1 - p) / profile.drafts for p in profile.per_position]
    return math.sqrt(sum(var) / len(var))


def distance(engine_mean: float, engine_rates: Sequence[float] | None, profile: Profile) -> float:
    """How far a profile is from an engine's: RMS over the common positions, else the mean's difference."""
    if profile.mean is None:
        return math.inf
    if engine_rates:
        k = min(len(engine_rates), len(profile.per_position))
        if k:
            return math.sqrt(sum((engine_rates[i] - profile.per_position[i]) ** 2 for i in range(k)) / k)
    return abs(engine_mean - profile.mean)


# --------------------------------------------------------------------------- prompts


def load_prompts(source: str | None, num_prompts: int) -> list:
    """Prompts as chat messages or text: a ``.jsonl`` (``messages``, ``prompt`` or ``text`` per line), a text
    file (one prompt per line), or ``None`` for the built-in mixed set (chat, code, math, story)."""
    if source is None:
        rows = [json.loads(line) for line in _builtin_file().read_text().splitlines() if line.strip()]
        by_id = {r["id"]: r for r in rows}
        return [by_id[i]["messages"] for i in BUILTIN_PROMPTS if i in by_id][:num_prompts]
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"no prompt file {path}: give a .jsonl or a text file (one prompt per line)")
    prompts: list = []
    if path.suffix == ".jsonl":
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            item = row.get("messages") or row.get("prompt") or row.get("text") if isinstance(row, dict) else row
            if not item:
                raise ValueError(f"{path}:{n} has no 'messages', 'prompt' or 'text' field")
            prompts.append(item)
    else:
        prompts = [line for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts[:num_prompts]


def _builtin_file() -> Path:
    import ddtree

    return Path(ddtree.__file__).parent / "data" / "prompts.jsonl"


def encode_prompts(tokenizer, prompts: list, vocab_size: int) -> list[torch.Tensor]:
    """Token ids per prompt: chat messages through the chat template when there is one."""
    chat = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
    out = []
    for p in prompts:
        if isinstance(p, str) and chat:
            p = [{"role": "user", "content": p}]
        if isinstance(p, list) and p and isinstance(p[0], int):
            ids = torch.tensor(p)
        elif tokenizer is None:
            raise ValueError("the target has no tokenizer: give prompts as token ids (a jsonl of id lists)")
        elif isinstance(p, list) and chat:
            ids = tokenizer.apply_chat_template(p, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)["input_ids"][0]
        else:
            text = "\n".join(m["content"] for m in p) if isinstance(p, list) else p
            ids = tokenizer(text, return_tensors="pt").input_ids[0]
        if ids.numel() == 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"prompt {len(out)} encodes to no tokens or ids outside the vocabulary ({vocab_size})")
        out.append(ids.view(1, -1))
    return out
