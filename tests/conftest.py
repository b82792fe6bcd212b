"""Fixtures built from ``tiny.py`` (tiny pairs, one thread per test) and the ``--slow`` option."""

from __future__ import annotations

import pytest
import tiny
import torch
from tiny import tiny_drafter, tiny_target, tiny_tokenizer

from ddtree.generation import generator


@pytest.fixture(autouse=True)
def one_thread():
    """Tests run tiny models: a second intra-op thread costs more than the math it takes over."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


REAL_DEFAULTS = {"DEFAULT_TREE_BUDGET": generator.DEFAULT_TREE_BUDGET,
                 "DEFAULT_PROMPT_LOOKUP": generator.DEFAULT_PROMPT_LOOKUP,
                 "DEFAULT_NUMERICS": generator.DEFAULT_NUMERICS}


@pytest.fixture(scope="session", autouse=True)
def fixed_default_budget():
    """The default tree budget is ``"auto"``, whose choices follow wall time. The suite's tests of the
    speculative path check acceptance against fixed expectations, so a generator built without a budget runs
    the earlier fixed default (4) here, and no merged prompt lookup (its branches change the trees those
    expectations were written for), and ``numerics="fast"`` unless a test asks for exact (tests compare the
    compiled round with the eager one on one target; tests/test_exact_numerics.py covers exact): for the whole
    session, so generators that module-scoped fixtures build see it too. A test marked ``real_default`` gets
    the real defaults back."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(generator, "DEFAULT_TREE_BUDGET", 4)
        patch.setattr(generator, "DEFAULT_PROMPT_LOOKUP", False)
        patch.setattr(generator, "DEFAULT_NUMERICS", {})
        yield


@pytest.fixture(autouse=True)
def restore_real_defaults(request, monkeypatch):
    if "real_default" in request.keywords:
        for name, value in REAL_DEFAULTS.items():
            monkeypatch.setattr(generator, name, value)


@pytest.fixture(params=["qwen3", "llama"])
def tiny_pair(request):
    target = tiny_target(request.param)
    return target, tiny_drafter(target)


@pytest.fixture(scope="session")
def saved_tiny_pair(tmp_path_factory):
    """A float32 tiny Llama target with a word-level tokenizer (and chat template) and its drafter, on disk."""
    root = tmp_path_factory.mktemp("tiny_pair")
    target = tiny_target("llama", dtype=torch.float32)
    target.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    tiny_drafter(target).save_pretrained(root / "drafter")
    return root / "target", root / "drafter"


@pytest.fixture(scope="session")
def readme_use_run():
    """The README's Use block run once, as written (it loads the default SmolLM2 pair and generates up to 256
    tokens): ``(its code, the names it left, what it printed)``. test_docs (every README block runs) and
    test_pretrained (the snippet stops at the end of the turn) both check this one run."""
    import contextlib
    import io
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    code = readme.split("## Use", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    scope: dict = {}
    printed = io.StringIO()
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a session fixture runs before the per-test one_thread
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(code, "README.md", "exec"), scope)
    finally:
        torch.set_num_threads(before)
    return code, scope, printed.getvalue()


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
    tiny.SLOW_FACTOR = SLOW_FACTOR if slow else 1


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow", default=False):
        return
    skip = pytest.mark.skip(reason="a long run: pass --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
