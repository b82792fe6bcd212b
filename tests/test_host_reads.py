"""The host-read counter sees each kind of read once, and nothing that stays on the device."""

from __future__ import annotations

import numpy as np
import torch

from ddtree.runtime.host_reads import count_host_reads


def _reads(fn, inference: bool = False):
    with torch.inference_mode(inference), count_host_reads() as reads:
        fn()
    return reads


def test_each_kind_of_read_counts_once():
    t = torch.tensor([1, 2, 3])
    # inference mode dispatches aten.item / is_nonzero, autograd mode their decompositions
    for inference in (False, True):
        cases = {
            "item": lambda: t[0].item(),
            "int": lambda: int(t[0]),
            "float": lambda: float(t[0]),
            "bool": lambda: bool((t == 1).any()),
            "tolist": lambda: t.tolist(),
            "numpy": lambda: t.numpy(),
            "cpu": lambda: t.cpu(),
            "index by a tensor": lambda: t[t[0]],
            "arange to a tensor's value": lambda: torch.arange(t[1]),
        }
        for name, fn in cases.items():
            assert _reads(fn, inference).count == 1, (name, inference)
    assert _reads(lambda: t.tolist()).by_kind == {"tolist": 1}
    assert _reads(lambda: bool(t.any())).by_kind == {"scalar": 1}
    assert _reads(lambda: int(t.sum()), inference=True).by_kind == {"scalar": 1}


def test_device_work_reads_nothing():
    t = torch.arange(12).view(3, 4)

    def work():
        m = t.max(dim=1).values
        g = t.gather(1, (t % 4))
        torch.where(g > 2, m[:, None], g).sum()
        torch.cat([t, t]).index_select(0, torch.tensor([0, 2]))

    assert _reads(work).count == 0


def test_counts_add_up_and_name_the_call_site():
    t = torch.tensor([4, 5])

    def three():
        int(t[0])
        t.tolist()
        np.asarray(t.numpy())

    reads = _reads(three)
    assert reads.count == 3
    assert sum(reads.by_site.values()) == 3
    assert all(site.startswith(f"{__name__}.three:") for site in reads.by_site)
    assert reads.sites(__name__) == 3 and reads.sites("ddtree.") == 0


def test_the_block_ends_the_count():
    t = torch.tensor([1])
    with count_host_reads() as reads:
        int(t)
    int(t)
    assert reads.count == 1


def test_the_bench_separates_the_rounds_one_read_from_the_builders(tmp_path):
    import json

    from ddtree.bench.host_reads import main

    out = tmp_path / "reads.json"
    assert main(["--methods", "best_first@4", "--batches", "2", "--rounds", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["method"], r["batch"], r["sampled"]) for r in rows] == [("best_first@4", 2, False),
                                                                       ("best_first@4", 2, True)]
    for r in rows:
        assert r["round"] == 1  # the round reads once; the device best_first reads nothing
        assert r["builder"] == 0 and r["lookup"] == 0 and r["total"] == 1
        in_round = {s: n for s, n in r["sites"].items() if s.startswith("ddtree.generation.round.")}
        assert list(in_round.values()) == [1] and next(iter(in_round)).startswith(
            "ddtree.generation.round._read_accepted:")
