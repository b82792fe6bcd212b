"""Tiny random target/drafter pairs (float64) and test drafters with known proposals."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from ddtree import DFlashConfig, DFlashDraftModel, DFlashDrafter

VOCAB = 97
MASK_ID = 96


def tiny_target(kind: str = "qwen3", seed: int = 0, dtype=torch.float64, vocab: int = VOCAB, **overrides):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )
    common.update(overrides)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(kind)
    # Sharpen the random target a little so greedy continuations are not degenerate.
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model.to(dtype).eval()


def tiny_drafter_model(target, seed: int = 1, block_size: int = 5, num_layers: int = 2, **cfg_overrides):
    torch.manual_seed(seed)
    cfg = DFlashConfig.for_target(
        target.config, num_hidden_layers=num_layers, block_size=block_size, mask_token_id=MASK_ID, **cfg_overrides
    )
    return DFlashDraftModel(cfg).to(next(target.parameters()).dtype).eval()


@pytest.fixture(autouse=True)
def one_thread():
    """Tests run tiny models: a second intra-op thread costs more than the math it takes over."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=["qwen3", "llama"])
def tiny_pair(request):
    target = tiny_target(request.param)
    return target, tiny_drafter_model(target)


class ScriptedDrafter:
    """A drafter whose proposals come from a known continuation (by absolute position).

    ``reference`` is the full token sequence the target will produce (or one per
    row of a batch: a list). At context length ``c`` (the root sits at ``c``)
    slot ``k`` proposes ``reference[c + k]`` with probability ``1 - eps``;
    ``decoy_at`` maps a depth (1-based) to a wrong token that gets the top rank
    there instead, pushing the right one to rank 1. Every proposal is logged in
    ``proposals``; the drafter keeps no per-generation state of its own.
    """

    def __init__(self, reference, vocab: int, block_size: int = 5, decoy_at: dict | None = None):
        refs = reference if isinstance(reference, (list, tuple)) else [reference]
        self.references = [torch.as_tensor(r).view(-1) for r in refs]
        self.vocab = vocab
        self.block_size = block_size
        self.target_layer_ids = [0]
        self.decoy_at = decoy_at or {}
        self.proposals: list[torch.Tensor] = []

    @property
    def reference(self) -> torch.Tensor:
        return self.references[0]

    def context_features(self, hidden_states):
        return hidden_states[-1]

    def new_context(self, batch_size: int = 1):
        return _ScriptedContext(self, batch_size)


class _ScriptedContext:
    def __init__(self, drafter: ScriptedDrafter, batch_size: int):
        self.drafter = drafter
        self.rows = list(range(batch_size))  # which reference each active row follows
        self.lengths = [0] * batch_size

    def append(self, features, tokens, counts=None):
        t = tokens.shape[1]
        counts = [t] * len(self.rows) if counts is None else [int(c) for c in counts]
        self.lengths = [n + c for n, c in zip(self.lengths, counts)]

    def select_rows(self, rows):
        keep = [int(r) for r in rows]
        self.rows = [self.rows[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]

    def propose(self, root_tokens):
        d = self.drafter
        depth = d.block_size - 1
        logits = torch.full((len(self.rows), depth, d.vocab), -30.0)
        for i, (row, length) in enumerate(zip(self.rows, self.lengths)):
            reference = d.references[min(row, len(d.references) - 1)]
            for k in range(1, depth + 1):
                pos = length + k
                if pos >= reference.numel():
                    continue
                right = int(reference[pos])
                logits[i, k - 1, right] = 10.0
                if k in d.decoy_at:
                    wrong = (right + 1 + d.decoy_at[k]) % d.vocab
                    logits[i, k - 1, wrong] = 12.0
        lp = logits.log_softmax(-1).to(root_tokens.device)
        d.proposals.append(lp)
        return lp


@pytest.fixture(scope="session")
def saved_tiny_pair(tmp_path_factory):
    """A float32 tiny Llama target with a word-level tokenizer (and chat template) and its drafter, on disk."""
    from _tiny import tiny_tokenizer

    root = tmp_path_factory.mktemp("tiny_pair")
    target = tiny_target("llama", dtype=torch.float32)
    target.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    tiny_drafter_model(target).save_pretrained(root / "drafter")
    return root / "target", root / "drafter"


# --------------------------------------------------------------------------- property-based tests (hypothesis)

SLOW_FACTOR = 20
"""``--slow`` multiplies every property test's example count by this."""


def pytest_addoption(parser):
    parser.addoption(
        "--slow", action="store_true", default=False,
        help=f"run the property-based tests with {SLOW_FACTOR}x more examples, not derandomized, "
             "and the long-run tests",
    )


def pytest_configure(config):
    from hypothesis import HealthCheck, settings

    common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                  print_blob=True)
    settings.register_profile("ddtree-ci", derandomize=True, **common)
    settings.register_profile("ddtree-slow", derandomize=False, **common)
    slow = config.getoption("--slow", default=False)
    settings.load_profile("ddtree-slow" if slow else "ddtree-ci")
    config.addinivalue_line("markers", "slow: runs only with --slow (long runs)")
    global _SLOW
    _SLOW = slow


_SLOW = False


def examples(n: int) -> int:
    """The example count for a property test: ``n`` in CI, ``SLOW_FACTOR * n`` with ``--slow``."""
    return n * SLOW_FACTOR if _SLOW else n


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow", default=False):
        return
    skip = pytest.mark.skip(reason="a long run: pass --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
