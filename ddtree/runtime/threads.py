"""How many CPU threads torch uses, chosen once and reported.

Small models on a CPU are very sensitive to oversubscription: with torch's
default (one thread per CPU) and another busy process on the same cores, each
matrix product waits for a thread that is not scheduled, and throughput can
fall about 20x (0.8 tok/s against 16-20 with one thread on two shared cores).
:func:`configure_threads` keeps a count the user chose and otherwise picks the
physical cores this process may run on, minus the ones other processes keep
busy, and warns when it sees the CPU is shared. :func:`warn_if_oversubscribed` changes nothing: it warns
(once per process) where code that leaves torch's count alone runs more threads than the CPUs left free.
Both name the way to change the count that the process's own tool takes (its ``--threads`` flag, given to
:func:`configure_threads`), or, in a program of the user's, the generator's ``threads=``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
_explicit: int | None = None  # the last count passed to configure_threads, kept by later policy calls
_warned_shared = False  # warn_if_oversubscribed has warned in this process
_fix: str | None = None  # how this process's tool takes a thread count (torch's count is the process's too)
GENERATOR_FIX = ("pass threads='auto' (the free cores) or threads=1 to SpeculativeGenerator or from_pretrained, "
                 "or set OMP_NUM_THREADS=1")


@dataclass(frozen=True)
class ThreadInfo:
    """What ran: ``threads`` / ``interop`` are torch's intra- and inter-op thread counts."""

    threads: int
    interop: int
    source: str  # "argument", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "user" (torch.set_num_threads) or "default"
    cpus: int  # logical CPUs this process may use
    physical_cores: int
    load: float | None  # 1-minute load average of the machine, None where unknown
    shared: bool  # other processes keep at least one of our CPUs busy

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        load = f", load {self.load:.1f}" if self.load is not None else ""
        shared = " (shared CPU)" if self.shared else ""
        return (f"torch threads {self.threads} ({self.source}), interop {self.interop}; "
                f"{self.physical_cores} physical cores / {self.cpus} CPUs available{load}{shared}")


def available_cpus() -> list[int]:
    """The logical CPUs this process may run on (its affinity mask, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def physical_cores(cpus: list[int] | None = None) -> int:
    """Distinct physical cores among ``cpus`` (hyper-thread siblings count once)."""
    cpus = available_cpus() if cpus is None else cpus
    seen = set()
    for c in cpus:
        sib = Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list")
        try:
            seen.add(sib.read_text().strip())
        except OSError:
            seen.add(str(c))
    return max(1, len(seen))


def machine_load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def default_threads(cores: int, load: float | None, cpus: int, processes: int = 1) -> int:
    """Physical cores, less the CPUs other processes keep busy (the load beyond our share), shared evenly by
    ``processes`` of one job on this machine (torchrun's local ranks), at least 1."""
    return max(1, min(cores, cpus - busy_cpus(load)) // max(1, processes))


def busy_cpus(load: float | None) -> int:
    """CPUs a load average keeps busy (rounded): 1.0 on two CPUs means one is taken."""
    return int(load + 0.5) if load else 0


def oversubscribed(threads: int, load: float | None, cpus: int) -> bool:
    """True when ``threads`` and the CPUs a load average keeps busy add up to more than ``cpus`` (with at least
    one CPU busy): where a small model's throughput collapses."""
    busy = busy_cpus(load)
    return threads > 1 and busy >= 1 and threads + busy > cpus


def shared_cpu_message(threads: int, load: float | None, cpus: int,
                       fix: str = "OMP_NUM_THREADS=1, torch.set_num_threads(1) or --threads 1") -> str:
    return (f"the CPU looks shared (load average {load or 0:.1f} on {cpus} CPUs) and torch runs {threads} threads: "
            f"throughput can fall ~20x when threads wait for busy cores. Use fewer threads ({fix}) or stop the "
            "other process.")


def warn_if_oversubscribed(*, load: Callable[[], float | None] | None = None,
                           cpus: Callable[[], list[int]] | None = None, stacklevel: int = 2) -> bool:
    """Warn, once per process, when torch's thread count exceeds the CPUs the load average leaves free;
    returns whether it warned now. For code that leaves torch's count alone (a generator with
    ``threads=None``): it changes nothing, it only says why generation may crawl and how to avoid it.
    ``load`` and ``cpus`` read the machine (default :func:`machine_load`, :func:`available_cpus`);
    ``stacklevel`` counts from the caller, as :func:`warnings.warn`'s does from its own caller."""
    global _warned_shared
    if _warned_shared:
        return False
    threads, figure, count = torch.get_num_threads(), (load or machine_load)(), len((cpus or available_cpus)())
    if not oversubscribed(threads, figure, count):
        return False
    _warned_shared = True
    warnings.warn(shared_cpu_message(threads, figure, count, _fix or GENERATOR_FIX) + " (Said once per process.)",
                  RuntimeWarning, stacklevel=stacklevel + 1)
    return True


def configure_threads(threads: int | None = None, *, warn: bool = True, fix: str | None = None,
                      processes: int = 1) -> ThreadInfo:
    """Set torch's thread count (unless the user already chose one) and return what runs.

    ``fix``: how the tool that calls this takes a thread count (e.g. ``"python -m ddtree.train --threads 1"``),
    named by this warning and by every later one in the process (a generator's with ``threads=None``
    included), since torch's count is the whole process's; ``processes``: the processes of one job on this
    machine (torchrun's local ranks), which share the default count.

    Order: an explicit ``threads``; ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``;
    a count passed here before and still in force (``--threads 2`` on a 2-CPU
    machine equals torch's default, and must stay when a generator applies the
    policy later); a count already set with ``torch.set_num_threads`` (anything
    other than torch's default of one per available CPU); else :func:`default_threads`.
    Warns when our threads and the CPUs other processes keep busy (the load
    average) add up to more than the CPUs we have: that is where it collapses.
    """
    global _explicit, _fix
    if fix is not None:
        _fix = fix
    cpus = available_cpus()
    cores = physical_cores(cpus)
    load = machine_load()
    shared = busy_cpus(load) >= 1
    if threads is not None:
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        torch.set_num_threads(threads)
        _explicit = threads
        source = "argument"
    elif _explicit is not None and torch.get_num_threads() == _explicit:
        source = "argument"
        warn = False  # said when it was chosen
    elif any(os.environ.get(v) for v in _ENV_VARS):
        source = next(v for v in _ENV_VARS if os.environ.get(v))
    elif torch.get_num_threads() != len(cpus):
        source = "user"
    else:
        torch.set_num_threads(default_threads(cores, load, len(cpus), processes))
        source = "default"
    info = ThreadInfo(torch.get_num_threads(), torch.get_num_interop_threads(), source, len(cpus), cores, load,
                      shared)
    if warn and oversubscribed(info.threads, load, len(cpus)):
        message = shared_cpu_message(info.threads, load, len(cpus)) if fix is None else \
            shared_cpu_message(info.threads, load, len(cpus), fix)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    return info


def thread_info() -> ThreadInfo:
    """What runs now, without changing anything (for stats)."""
    cpus = available_cpus()
    load = machine_load()
    src = next((v for v in _ENV_VARS if os.environ.get(v)), "current")
    return ThreadInfo(torch.get_num_threads(), torch.get_num_interop_threads(), src, len(cpus),
                      physical_cores(cpus), load, busy_cpus(load) >= 1)
