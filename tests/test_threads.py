"""Thread defaults: a user's choice is kept, a shared CPU gets fewer threads and a warning, and what ran is reported."""

from __future__ import annotations

import warnings

import pytest
import torch

from ddtree.runtime import threads


@pytest.fixture
def machine(monkeypatch):
    """Pretend to be a 4-CPU machine (2 physical cores with 2 hyper-threads each) at a given load."""
    state = {"load": 0.0}
    monkeypatch.setattr(threads, "available_cpus", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(threads, "physical_cores", lambda cpus=None: 2)
    monkeypatch.setattr(threads, "machine_load", lambda: state["load"])
    for var in threads._ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(threads, "_explicit", None)
    monkeypatch.setattr(threads, "_warned_shared", False)  # each test starts as a fresh process
    monkeypatch.setattr(threads, "_fix", None)
    torch.set_num_threads(4)  # torch's own default: one per available CPU
    return state


def test_idle_machine_uses_the_physical_cores(machine):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        info = threads.configure_threads()
    assert (info.threads, info.source, info.shared) == (2, "default", False)
    assert torch.get_num_threads() == 2


def test_a_busy_cpu_leaves_room_and_warns_only_when_threads_still_compete(machine):
    machine["load"] = 3.0  # three CPUs busy elsewhere
    info = threads.configure_threads()
    assert (info.threads, info.shared) == (1, True)
    torch.set_num_threads(4)
    machine["load"] = 1.2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 2 threads + 1 busy CPU fit in 4 CPUs: no warning
        info = threads.configure_threads()
    assert info.threads == 2 and info.shared  # 4 CPUs - 1 busy, capped at the 2 physical cores
    machine["load"] = 2.6
    with pytest.warns(RuntimeWarning, match="shared.*OMP_NUM_THREADS=1"):
        threads.configure_threads(2)  # 2 threads + 3 busy CPUs > 4


def test_the_users_choice_is_kept(machine, monkeypatch):
    machine["load"] = 3.0
    torch.set_num_threads(3)
    with pytest.warns(RuntimeWarning):
        info = threads.configure_threads()
    assert (info.threads, info.source) == (3, "user")
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    torch.set_num_threads(4)
    with pytest.warns(RuntimeWarning):
        assert threads.configure_threads().source == "OMP_NUM_THREADS"
    assert threads.configure_threads(1).source == "argument" and torch.get_num_threads() == 1
    with pytest.raises(ValueError, match="threads must be an int >= 1"):
        threads.configure_threads(0)


def test_an_explicit_count_equal_to_torchs_default_survives_the_policy(machine):
    """``--threads 4`` on the 4-CPU machine: torch's default count, chosen on purpose; a generator built
    afterwards with threads="auto" keeps it (it used to fall back to the load policy's 1 thread)."""
    from tiny import tiny_drafter, tiny_target

    from ddtree import SpeculativeGenerator

    machine["load"] = 3.0
    with pytest.warns(RuntimeWarning):
        threads.configure_threads(4)
    target = tiny_target("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, when it was chosen
        gen = SpeculativeGenerator(target, tiny_drafter(target), threads="auto")
    assert torch.get_num_threads() == 4 and gen.threads.source == "argument"
    torch.set_num_threads(4)  # set again by hand: still the choice
    assert threads.configure_threads(warn=False).threads == 4
    threads.configure_threads(1)
    torch.set_num_threads(4)  # a later change by other code: no longer the explicit choice, the policy applies
    assert threads.configure_threads(warn=False).threads == 1


def test_thread_info_reports_without_changing(machine):
    torch.set_num_threads(3)
    info = threads.thread_info()
    assert info.threads == 3 and torch.get_num_threads() == 3
    assert info.as_dict()["interop"] == torch.get_num_interop_threads()
    assert "torch threads 3" in info.describe()


def test_real_topology_is_sane():
    cpus = threads.available_cpus()
    assert 1 <= threads.physical_cores(cpus) <= len(cpus)


def test_a_generator_leaves_torchs_threads_alone_unless_asked(machine):
    """Torch's thread count is the whole process's: a generator built with the defaults (or ``threads=None``)
    leaves it, on the shared 4-CPU machine (3 CPUs busy) as anywhere; ``threads="auto"`` applies the demo's
    policy (torch's default of 4 threads becomes 1); an int sets it."""
    from tiny import tiny_drafter, tiny_target

    from ddtree import GeneratorOptions, SpeculativeGenerator

    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    machine["load"] = 3.0
    torch.set_num_threads(4)
    with pytest.warns(RuntimeWarning, match="looks shared"):  # it says so, once, but changes nothing
        plain = SpeculativeGenerator(target, drafter)
    assert plain.threads is None and plain.options.threads is None and torch.get_num_threads() == 4
    assert plain.generate([5, 17, 3], max_new_tokens=3).stats.threads["threads"] == 4 == torch.get_num_threads()
    assert SpeculativeGenerator(target, drafter, threads=None).threads is None and torch.get_num_threads() == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 1 thread + 3 busy CPUs fit: no warning
        gen = SpeculativeGenerator(target, drafter, options=GeneratorOptions(threads="auto"))
    assert torch.get_num_threads() == 1 and (gen.threads.threads, gen.threads.source) == (1, "default")
    torch.set_num_threads(4)
    with pytest.warns(RuntimeWarning, match="looks shared"):  # 2 threads + 3 busy CPUs > 4: the measured fix
        assert SpeculativeGenerator(target, drafter, threads=2).threads.source == "argument"
    assert torch.get_num_threads() == 2
    torch.set_num_threads(4)
    out = SpeculativeGenerator(target, drafter, threads="auto").generate([5, 17, 3], max_new_tokens=3)
    assert out.stats.threads["threads"] == 1  # the stats report what ran
    with pytest.raises(ValueError, match="threads must be 'auto', an int >= 1 or None"):
        SpeculativeGenerator(target, drafter, threads=0)
    with pytest.raises(ValueError, match="threads must be 'auto', an int >= 1 or None"):
        GeneratorOptions(threads="all")
    with pytest.raises(ValueError, match="threads prepares the models, so it is set on the generator"):
        gen.generate([5, 17, 3], max_new_tokens=3, threads=2)


def test_oversubscription_is_threads_beyond_the_cpus_the_load_leaves_free():
    assert threads.oversubscribed(2, 3.4, 2)  # the machine: 2 CPUs, load 3-4, torch's 2 threads
    assert threads.oversubscribed(2, 1.0, 2)  # one CPU busy elsewhere, two threads
    assert not threads.oversubscribed(1, 3.4, 2)  # one thread never waits for a sibling
    assert not threads.oversubscribed(2, 0.3, 2)  # idle: no CPU busy
    assert not threads.oversubscribed(2, None, 2)  # load unknown
    assert not threads.oversubscribed(2, 1.2, 4)  # 2 threads + 1 busy CPU fit in 4


def test_the_default_generator_warns_once_per_process_and_changes_nothing(monkeypatch):
    """``threads=None`` keeps torch's count (the process's): on a busy CPU it warns once, naming the fix, and the
    warning points at the caller's line. The load and CPU figures are injected, so the machine does not matter."""
    from tiny import tiny_drafter, tiny_target

    from ddtree import SpeculativeGenerator

    monkeypatch.setattr(threads, "_warned_shared", False)
    monkeypatch.setattr(threads, "_fix", None)  # no tool chose the threads in this process
    two_cpus, busy, idle = (lambda: [0, 1]), (lambda: 3.4), (lambda: 0.2)
    torch.set_num_threads(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not threads.warn_if_oversubscribed(load=idle, cpus=two_cpus)
        torch.set_num_threads(1)
        assert not threads.warn_if_oversubscribed(load=busy, cpus=two_cpus)
    torch.set_num_threads(2)
    with pytest.warns(RuntimeWarning, match=r"load average 3\.4 on 2 CPUs\) and torch runs 2 threads.*"
                                            r"threads='auto'.*OMP_NUM_THREADS=1") as caught:
        assert threads.warn_if_oversubscribed(load=busy, cpus=two_cpus, stacklevel=1)
    assert caught[0].filename == __file__  # stacklevel=1: this line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not threads.warn_if_oversubscribed(load=busy, cpus=two_cpus)  # once per process
    assert torch.get_num_threads() == 2

    monkeypatch.setattr(threads, "_warned_shared", False)
    monkeypatch.setattr(threads, "machine_load", busy)
    monkeypatch.setattr(threads, "available_cpus", two_cpus)
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    with pytest.warns(RuntimeWarning, match="threads='auto'") as caught:
        SpeculativeGenerator(target, drafter)
    assert caught[0].filename == __file__ and torch.get_num_threads() == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SpeculativeGenerator(target, drafter)  # said already
        monkeypatch.setattr(threads, "_warned_shared", False)
        monkeypatch.setattr(threads, "_explicit", None)
        for var in threads._ENV_VARS:
            monkeypatch.delenv(var, raising=False)
        gen = SpeculativeGenerator(target, drafter, threads="auto")  # the fix: 2 CPUs less 3 busy -> 1 thread
    assert torch.get_num_threads() == 1 and gen.threads.threads == 1


def test_the_training_cli_picks_threads_as_the_other_tools_do(machine, monkeypatch):
    """``python -m ddtree.train`` applies the demo's thread policy (it left torch's one thread per CPU, which
    crawls on a shared CPU): the free physical cores by default, split between torchrun's local ranks; a
    ``--threads`` count or ``OMP_NUM_THREADS`` kept. ``run`` applies it before anything loads."""
    from ddtree.train import __main__ as train_main
    from ddtree.train.config import parse_args

    assert train_main.pick_threads(parse_args(["--out-dir", "x"])).threads == 2  # the 2 physical cores
    assert torch.get_num_threads() == threads.configure_threads().threads == 2  # what the demo picks
    torch.set_num_threads(4)
    machine["load"] = 3.0
    with pytest.warns(RuntimeWarning, match=r"python -m ddtree\.train --threads 1"):  # 1 thread + 3 busy > 4
        assert train_main.pick_threads(parse_args(["--out-dir", "x", "--threads", "2"])).threads == 2
    machine["load"] = 0.0
    torch.set_num_threads(4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks on this machine share its 2 cores
    assert train_main.pick_threads(parse_args(["--out-dir", "x"])).threads == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    torch.set_num_threads(4)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    info = train_main.pick_threads(parse_args(["--out-dir", "x"]))
    assert (info.threads, info.source) == (4, "OMP_NUM_THREADS")  # the user's environment is kept
    monkeypatch.delenv("OMP_NUM_THREADS")

    torch.set_num_threads(4)
    seen = []
    monkeypatch.setattr(train_main, "_run", lambda *a: seen.append(torch.get_num_threads()) or {})
    train_main.run(parse_args(["--out-dir", "x", "--device", "cpu"]), log_fn=lambda m: seen.append(m))
    assert seen[-1] == 2 and any("[threads] torch threads 2 (default)" in str(m) for m in seen)


def test_a_shared_cpu_warning_inside_a_tool_names_that_tools_flag(machine):
    """The train run's own generator leaves torch's threads alone and warns on a shared CPU: the warning names
    the training CLI's ``--threads``, which the user can change, not ``SpeculativeGenerator(threads=)``."""
    from ddtree.train import __main__ as train_main
    from ddtree.train.config import parse_args

    train_main.pick_threads(parse_args(["--out-dir", "x"]))
    torch.set_num_threads(2)
    machine["load"] = 3.4
    with pytest.warns(RuntimeWarning, match=r"\(python -m ddtree\.train --threads 1, or OMP_NUM_THREADS=1\)") as w:
        assert threads.warn_if_oversubscribed()
    assert "SpeculativeGenerator" not in str(w[0].message)
