"""Ranks that run one generation together: decide once on rank 0, share, and fail together.

A tensor-parallel target (``from_pretrained(..., tp_plan="auto")`` under
``torchrun``) makes every target forward a collective: each rank must run the
same forwards on the same inputs, in the same order, or they hang. ddtree's
rounds are deterministic given their inputs, except where a rank's own clock
or RNG could steer them (the auto budget, a default seed, sampling draws). At
those points :class:`Lockstep` takes rank 0's value and gives it to every rank.

Everything here is a no-op for a target that is not sharded over ranks (plain,
``device_map``, or one replica per rank in a data-parallel run): ``Lockstep``
then has no group and returns what it is given. Data-parallel helpers
(:func:`shard`, :func:`gather_object`) are for the benchmark, whose ranks run
different prompts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import pickle
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class RankFailedError(RuntimeError):
    """Another rank raised while this one was fine: every rank stops with the failing rank's error."""


def is_distributed() -> bool:
    """True when torch.distributed is initialised with more than one rank."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank(group: ProcessGroup | None = None) -> int:
    import torch.distributed as dist

    return dist.get_rank(group) if is_distributed() else 0


def world_size(group: ProcessGroup | None = None) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group) if is_distributed() else 1


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly) sharded parameter: a DTensor's ``full_tensor()``, else ``t`` itself.

    A collective for a DTensor: every rank of its mesh must call it."""
    if hasattr(t, "full_tensor") and hasattr(t, "device_mesh"):
        return t.full_tensor()
    return t


def model_group(model: Any) -> ProcessGroup | None:
    """The process group ``model``'s parameters are sharded over (tensor parallel), or ``None``."""
    if not is_distributed():
        return None
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        for p in model.parameters():
            if hasattr(p, "device_mesh") and hasattr(p, "full_tensor"):
                mesh = p.device_mesh
                break
    if mesh is None or mesh.size() < 2:
        return None
    return mesh.get_group() if mesh.ndim == 1 else mesh.get_group("tp")


def _device_for(group: ProcessGroup | None) -> torch.device:
    """Where a backend takes its tensors: the current CUDA device for NCCL, the CPU otherwise."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_object(obj: Any, group: ProcessGroup | None = None, src_rank: int = 0) -> Any:
    """``obj`` as group rank ``src_rank`` has it, on every rank of ``group`` (pickled; keep it small)."""
    import torch.distributed as dist

    src = dist.get_global_rank(group, src_rank) if group is not None else src_rank
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group, device=_device_for(group))
    return box[0]


def all_gather_object(obj: Any, group: ProcessGroup | None = None) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def rank0_decides(decide: Callable[[], Any], group: ProcessGroup | None = None) -> Any:
    """Run ``decide`` on rank 0 only and return its value on every rank (an error there raises everywhere)."""
    if not is_distributed():
        return decide()
    value, error = None, None
    if rank(group) == 0:
        try:
            value = decide()
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            error = f"{type(exc).__name__}: {exc}"
    value, error = broadcast_object((value, error), group)
    if error is not None:
        raise RankFailedError(f"rank 0 failed: {error}")
    return value


@contextlib.contextmanager
def fail_together(what: str, group: ProcessGroup | None = None) -> Iterator[None]:
    """Run a block on every rank; when it raises on any rank, raise on every rank instead of hanging.

    The failing rank re-raises its own exception; the others raise
    :class:`RankFailedError` naming the rank and its error. Blocks may nest: an
    error already shared passes through. Collectives inside the block must not
    depend on data that can fail on one rank only (put those checks first)."""
    if not is_distributed():
        yield
        return
    error: BaseException | None = None
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - shared, then re-raised
        if isinstance(exc, RankFailedError) or getattr(exc, "_ddtree_shared", False):
            raise  # an inner block (or an agreement) already told every rank
        error = exc
    reports = all_gather_object(None if error is None else f"{type(error).__name__}: {error}", group)
    if error is not None:
        error._ddtree_shared = True  # type: ignore[attr-defined]  # a marker set on the exception object
        raise error
    failed = [(r, msg) for r, msg in enumerate(reports) if msg is not None]
    if failed:
        r, msg = failed[0]
        raise RankFailedError(f"rank {r} failed while {what}: {msg}")


def fingerprint(obj: Any) -> str:
    """A short digest of a picklable value, to compare across ranks without sending it whole."""
    return hashlib.sha256(pickle.dumps(obj, protocol=4)).hexdigest()[:16]


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor, Any], torch.Tensor], like: Any = None) -> Any:
    """``obj`` with ``fn(tensor, matching part of like)`` applied to every tensor, through tuples, lists,
    dicts and dataclasses."""
    if isinstance(obj, torch.Tensor):
        return fn(obj, like)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{
            f.name: _map_tensors(getattr(obj, f.name), fn, getattr(like, f.name, None))
            for f in dataclasses.fields(obj) if f.init
        })
    if isinstance(obj, (list, tuple)):
        likes = like if isinstance(like, (list, tuple)) and len(like) == len(obj) else [None] * len(obj)
        return type(obj)(_map_tensors(o, fn, lk) for o, lk in zip(obj, likes))
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn, like.get(k) if isinstance(like, dict) else None) for k, v in obj.items()}
    return obj


class Lockstep:
    """The ranks of one tensor-parallel target: decisions from rank 0, shared; failures, shared.

    ``Lockstep.for_model(target)`` has no group when the target is not sharded
    over ranks, and then every method returns its input: the hooks in the
    generator, the round and the budget cost nothing outside ``torchrun``.
    """

    def __init__(self, group: ProcessGroup | None = None) -> None:
        self.group = group

    @classmethod
    def for_model(cls, model: Any) -> Lockstep:
        return cls(model_group(model))

    @property
    def active(self) -> bool:
        return self.group is not None

    @property
    def rank(self) -> int:
        return rank(self.group) if self.active else 0

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (tensors come back on the local value's device)."""
        if not self.active:
            return value
        sent = _map_tensors(value, lambda t, _: t.detach().cpu()) if self.rank == 0 else None
        got = broadcast_object(sent, self.group)
        return _map_tensors(got, lambda t, local: t.to(local.device if isinstance(local, torch.Tensor) else "cpu"),
                            value)

    def decide(self, decide: Callable[[], Any]) -> Any:
        """``decide()`` run on rank 0 only, its value on every rank."""
        return rank0_decides(decide, self.group) if self.active else decide()

    def fail_together(self, what: str) -> contextlib.AbstractContextManager[None]:
        """See :func:`fail_together`; a plain block when not active."""
        return fail_together(what, self.group) if self.active else contextlib.nullcontext()

    def agree(self, value: Any, what: str) -> None:
        """Raise on every rank unless every rank passed the same ``value`` (compared by digest)."""
        if not self.active:
            return
        digests = all_gather_object(fingerprint(value), self.group)
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        if differ:
            raise RankFailedError(
                f"ranks disagree on {what}: rank(s) {differ} differ from rank 0. A tensor-parallel target needs "
                "the same call on every rank (same prompts, options and seed, same drafter): pass identical "
                "arguments on every rank"
            )


def shard(items: Sequence, group: ProcessGroup | None = None) -> list:
    """This rank's share of ``items`` (every ``world_size``-th, from its rank): the data-parallel split."""
    return list(items[rank(group)::world_size(group)])


def module_fingerprint(module: torch.nn.Module | None) -> tuple:
    """Shapes, dtypes and a float64 checksum of a module's parameters: equal on ranks that hold the same weights."""
    if module is None:
        return ()
    with torch.no_grad():
        return tuple((name, tuple(p.shape), str(p.dtype), float(p.detach().double().sum()))
                     for name, p in module.named_parameters())


def before_process_group() -> None:
    """Call before a process group is made (by ``init_process_group`` or by loading with ``tp_plan``).

    ``torch.distributed.nn`` takes ``group.WORLD`` as a default argument, read when it is imported; transformers
    imports it while loading. Imported after the group exists, it would keep that group alive past
    ``destroy_process_group``, and the group's gloo threads, still running at interpreter exit, can abort a
    run that succeeded ("terminate called without an active exception").
    """
    import torch.distributed as dist

    if dist.is_available() and not dist.is_initialized():
        import torch.distributed.nn  # noqa: F401  # binds group=None, which means the default group at call time


def start_data_parallel(device: str) -> str:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1), join the process group (NCCL for CUDA, gloo otherwise) and
    return this rank's device (``cuda`` becomes ``cuda:LOCAL_RANK``); outside it, return ``device`` unchanged."""
    import os

    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return device
    cuda = str(device).startswith("cuda")
    if cuda and str(device) == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    if cuda:
        torch.cuda.set_device(torch.device(device))
    if not dist.is_initialized():
        before_process_group()
        dist.init_process_group("nccl" if cuda else "gloo")
        _STARTED.append(True)
    return device


_STARTED: list[bool] = []  # whether start_data_parallel created the process group (so stop may destroy it)


def stop_data_parallel(wait: bool = True) -> None:
    """Leave the process group that :func:`start_data_parallel` created (a group it found is left alone)."""
    if _STARTED:
        leave_process_group(wait)
        _STARTED.clear()


def leave_process_group(wait: bool = True) -> None:
    """Destroy this process's group, after a barrier when ``wait``, so that ranks leave together.

    A rank that exits with its gloo group alive can abort in the group's destructor
    ("terminate called without an active exception"), failing a run that succeeded. ``wait=False``
    (a rank that is failing) leaves without the barrier, which the other ranks may never reach.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()


def gather_lists(items: list, group: ProcessGroup | None = None) -> list[list]:
    """Every rank's list, in rank order (a data-parallel run's results, on every rank)."""
    return all_gather_object(list(items), group) if is_distributed() else [list(items)]


def check_tp_divides(config: Any, ranks: int) -> None:
    """Raise a ValueError, before loading, when ``tp_plan`` cannot split ``config``'s heads over ``ranks``."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    sizes = {name: getattr(cfg, name, None) for name in ("num_attention_heads", "num_key_value_heads")}
    bad = {k: v for k, v in sizes.items() if isinstance(v, int) and v % ranks}
    if bad:
        counts = [v for v in sizes.values() if isinstance(v, int)]
        fits = [n for n in range(1, max(counts) + 1) if all(v % n == 0 for v in counts)]
        raise ValueError(f"tp_plan shards attention heads over the {ranks} ranks, but the target has "
                         + ", ".join(f"{k}={v}" for k, v in sizes.items())
                         + f": launch torchrun with --nproc_per_node in {fits}, or split layers with device_map")
