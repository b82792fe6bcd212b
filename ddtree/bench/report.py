"""The bench's results: per-method summaries, the markdown table, the plots and the run's metadata."""

from __future__ import annotations

import datetime
import platform
import statistics
from collections.abc import Iterable
from pathlib import Path

import torch

from ddtree.bench.methods import STAGES, Method
from ddtree.bench.noise import comparison_lines, mean_and_se, round_rate, spread_ms, verify_order_notes
from ddtree.bench.prompts import DEFAULT_PROMPTS
from ddtree.bench.runner import Run, lossless_check
from ddtree.budget.decide import FIXED, REASONS
from ddtree.runtime import distributed
from ddtree.runtime.threads import ThreadInfo, thread_info
from ddtree.targets import cpu_linear


def summarize(runs: list[Run], methods: list[Method], depth: int, greedy: bool) -> list[dict]:
    """One dict per method: tau, per-depth acceptance, tokens/s, speedup, stage seconds, lossless."""
    repeats = sorted({r.repeat for r in runs})
    checks = lossless_check(runs) if greedy else {}

    def tps(name: str, rep: int) -> float:  # summed over data-parallel ranks, which run side by side
        rs = [r for r in runs if r.method == name and r.repeat == rep]
        return sum(sum(r.new_tokens for r in rs if r.rank == k) / max(sum(r.seconds for r in rs if r.rank == k),
                                                                      1e-12) for k in {r.rank for r in rs})

    rows = []
    for m in methods:
        rs = [r for r in runs if r.method == m.name]
        if not rs:
            continue
        acc = [a for r in rs for a in r.acceptance]
        per_rep = [tps(m.name, k) for k in repeats]
        speedups = [tps(m.name, k) / tps("ar", k) for k in repeats]
        stage_totals: dict[str, float] = {}
        for r in rs:
            for k, v in r.stage_seconds.items():
                stage_totals[k] = stage_totals.get(k, 0.0) + v
        rounds = len(acc)
        round_seconds = [x for r in rs for x in r.round_seconds]
        decode_rate, decode_se = round_rate([t for r in rs for t in r.round_tokens], round_seconds)
        verify_ms, verify_se = mean_and_se(_verify_ms_per_run(rs, m))
        reach = [sum(a - 1 >= d for a in acc) / rounds for d in range(1, depth + 1)] if acc else []
        nodes = [sum(col) for col in zip(*(_padded(r.nodes_per_depth, depth) for r in rs))] if acc else []
        row = {
            "method": m.name,
            "builder": m.builder or None,
            "budget": m.budget if m.budget is not None else depth,
            "tau": statistics.fmean(acc) if acc else 1.0,
            "tau_std": statistics.pstdev(acc) if len(acc) > 1 else 0.0,
            "tau_p10_p90": _quantiles(acc) if acc else [1, 1],
            "depth_acceptance": reach,
            "acceptance_at_depth": [None if above == 0 else here / above for above, here in zip([1.0] + reach, reach)],
            "nodes_per_depth": [n / rounds for n in nodes] if any(nodes) else [],
            "tokens_per_second": statistics.median(per_rep),
            "tokens_per_second_per_repeat": per_rep,
            "speedup": statistics.median(speedups),
            "speedup_per_repeat": speedups,
            "rounds": rounds if m.kind == "tree" else len(round_seconds),
            "new_tokens": sum(r.new_tokens for r in rs),
            "round_ms": spread_ms(round_seconds),
            "decode_tokens_per_second": decode_rate,
            "decode_rate_rel_se": decode_se,
            "nodes_per_verify": 1 + sum(nodes) / rounds if acc else 1.0 if m.kind == "ar" else None,
            "verify_ms": verify_ms,
            "verify_ms_se": verify_se,
            "stage_seconds_per_run": {k: v / len(rs) for k, v in stage_totals.items()},
            "stage_ms_per_round": {k: 1e3 * v / rounds for k, v in stage_totals.items()} if rounds else {},
            "mean_budget": statistics.fmean(b for r in rs for b in r.budgets) if rounds else 0,
            "lossless": checks.get(m.name, {}).get("lossless") if m.name != "ar" else (True if greedy else None),
            "lossless_detail": checks.get(m.name),
            "tau_by_category": _tau_by_category(rs) if acc else {},
            "accepted_by_source": _sum_sources(rs),
            "budget_reasons": budget_reasons(x for r in rs for x in r.reasons) or None,
        }
        if m.kind == "tree":
            row["budget_histogram"] = _histogram(b for r in rs for b in r.budgets) if m.budget == "auto" else None
        rows.append(row)
    return rows


def budget_reasons(reasons: Iterable[str]) -> dict[str, int]:
    """Rounds by reason, the most common first (ties in :data:`~ddtree.budget.decide.REASONS` order, then by
    name): what the tables print."""
    counts: dict[str, int] = {}
    for r in reasons:
        counts[r] = counts.get(r, 0) + 1
    order = {r: i for i, r in enumerate(REASONS)}
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], order.get(kv[0], len(order)), kv[0])))


def reasons_text(counts: dict[str, int] | None) -> str:
    """``best rate 41, explore 6, retry 2`` (``–`` for none): most rounds first, then by name, so the text does not
    depend on which reason a run met first."""
    if not counts:
        return "–"
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def reasons_section(rows: list[dict], label=lambda r: r["method"]) -> str:
    """One line per row that had tree rounds: its rounds by reason (``budget_reasons``); empty when every round
    of every row had a fixed budget (the rounds column says as much)."""
    rows = [r for r in rows if r.get("budget_reasons")]
    if not any(set(r["budget_reasons"]) - {FIXED} for r in rows):
        return ""
    lines = [f"- {label(r)}: {reasons_text(r['budget_reasons'])}" for r in rows]
    return ("\nTree rounds by the reason for their budget (stats.reasons), summed over the timed calls; "
            "fixed: a fixed budget:\n\n" + "\n".join(lines) + "\n")


def _verify_ms_per_run(rs: list[Run], m: Method) -> list[float]:
    """Per run: the target forward of a round in ms (a tree's verify stage; a plain method's decode step)."""
    if m.kind == "tree":
        return [1e3 * r.stage_seconds.get("verify", 0.0) / len(r.acceptance) for r in rs if r.acceptance]
    return [1e3 * r.stage_seconds["decode"] / len(r.round_seconds) for r in rs
            if r.round_seconds and "decode" in r.stage_seconds]


def _padded(xs: list[int], n: int) -> list[int]:
    return list(xs) + [0] * (n - len(xs))


def _tau_by_category(rs: list[Run]) -> dict[str, float]:
    cats: dict[str, list[int]] = {}
    for r in rs:
        cats.setdefault(r.category or "-", []).extend(r.acceptance)
    return {c: round(statistics.fmean(a), 3) for c, a in sorted(cats.items()) if a}


def _sum_sources(rs: list[Run]) -> dict[str, int] | None:
    total: dict[str, int] = {}
    for r in rs:
        for k, v in (r.accepted_by_source or {}).items():
            total[k] = total.get(k, 0) + v
    return total or None


def _quantiles(xs: list[int]) -> list[float]:
    s = sorted(xs)
    return [s[int(0.1 * (len(s) - 1))], s[int(0.9 * (len(s) - 1))]]


def _histogram(xs: Iterable[int]) -> dict[str, int]:
    h: dict[int, int] = {}
    for x in xs:
        h[x] = h.get(x, 0) + 1
    return {str(k): v for k, v in sorted(h.items())}


def markdown_table(rows: list[dict]) -> str:
    """One row per method; the speedup's min–max over repeats only where there are several."""
    repeats = max((len(r["speedup_per_repeat"]) for r in rows), default=0)
    spread = " (min–max over repeats)" if repeats > 1 else ""
    head = (
        f"| method | budget | rounds | tokens/round (± std) | tok/s | speedup vs ar{spread} | draft | build | mask "
        "| verify | commit | lossless |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|\n"
    )
    lines = []
    for r in rows:
        ms = r["stage_ms_per_round"]
        stages = " | ".join(f"{ms.get(s, 0.0):.1f}" if ms else "–" for s in STAGES)
        budget = r["budget"] if r["budget"] != "auto" else f"auto (mean {r['mean_budget']:.0f})"
        lossless = {True: "yes", False: "**NO**", None: "n/a"}[r["lossless"]]
        sp = r["speedup_per_repeat"]
        speedup = f"{r['speedup']:.2f}x" + (f" ({min(sp):.2f}–{max(sp):.2f})" if len(sp) > 1 else "")
        lines.append(
            f"| {r['method']} | {budget} | {r['rounds'] or '–'} | {r['tau']:.2f} ± {r['tau_std']:.2f} | "
            f"{r['tokens_per_second']:.1f} | {speedup} | {stages} | {lossless} |"
        )
    note = ("\nrounds: verify rounds after the prefill (ar: decode steps); tokens/round counts the tokens a round "
            "commits (accepted + bonus). Stage columns are milliseconds per verify round.\n")
    return head + "\n".join(lines) + "\n" + note


def cost_table(rows: list[dict]) -> str:
    """A plain step beside a verify, by nodes per round: what a round costs and how much its time spreads,
    then the pairs whose verify times do not rise with the nodes, and whether that is noise."""
    rows = sorted((r for r in rows if r.get("verify_ms") is not None), key=lambda r: r["nodes_per_verify"])
    if not rows:
        return ""
    lines = []
    for r in rows:
        se = "" if r["verify_ms_se"] is None else f" ± {r['verify_ms_se']:.2f}"
        rm = r["round_ms"]
        spread = "–" if rm is None else f"{rm['median']:.2f} ({rm['p10']:.2f}–{rm['p90']:.2f})"
        per_token = "–" if not r["decode_tokens_per_second"] else f"{1e3 / r['decode_tokens_per_second']:.2f}"
        lines.append(f"| {r['method']} | {r['nodes_per_verify']:.1f} | {r['verify_ms']:.2f}{se} | {spread} | "
                     f"{r['tau']:.2f} | {per_token} |")
    notes = verify_order_notes(rows)
    return ("\nRound cost by nodes per verify (ar: one plain step, 1 node). verify ms: the target forward of a "
            "round, mean over runs ± its standard error (runs: prompts x repeats); round ms: the whole round, "
            "median (10th–90th percentile) over rounds:\n\n"
            "| method | nodes per verify | verify ms | round ms | tokens/round | ms per token |\n"
            "|---|---:|---:|---:|---:|---:|\n" + "\n".join(lines) + "\n"
            + ("\n" + "\n".join(f"- {n}" for n in notes) + "\n" if notes else ""))


def comparison_section(comps: dict) -> str:
    """The comparisons (each method against ar and against the fastest) with a line on how noise was judged."""
    lines = comparison_lines(comps)
    if not lines:
        return ""
    return ("\nIs the difference real? A ratio counts as faster or slower only when every noise source the run "
            "has puts it on one side of 1: the per-repeat ratios (with 2+ repeats) and the 95% interval of the "
            "ratio of decode rates (tokens over seconds of the rounds after the prefill) from the rounds' "
            "spread.\n" + lines)


def depth_tables(rows: list[dict]) -> str:
    """Per depth d, one column each: P(a round reaches d), the acceptance at d (P(reach d) / P(reach d - 1)),
    and the mean draft nodes at d per round (the trees' shape), one row per tree method."""
    rows = [r for r in rows if r["depth_acceptance"]]
    if not rows:
        return ""
    depth = max(max(len(r["depth_acceptance"]), len(r["nodes_per_depth"])) for r in rows)
    cols = " | ".join(f"d={d}" for d in range(1, depth + 1))
    rule = "|---|" + "---:|" * depth

    def table(title: str, key: str, fmt) -> str:
        lines = [f"| {r['method']} | " + " | ".join(fmt(v) for v in _padded_values(r[key], depth)) + " |" for r in rows]
        return f"\n{title}\n\n| method | {cols} |\n{rule}\n" + "\n".join(lines) + "\n"

    return (table("P(round reaches depth d), accepted draft tokens >= d:", "depth_acceptance", _cell(".2f"))
            + table("Acceptance at depth d, P(reach d) / P(reach d - 1):", "acceptance_at_depth", _cell(".2f"))
            + table("Mean draft nodes at depth d per round (the trees' shape):", "nodes_per_depth", _cell(".1f")))


def _padded_values(xs: list, n: int) -> list:
    return list(xs) + [None] * (n - len(xs))


def _cell(spec: str):
    return lambda v: "–" if v is None else format(v, spec)


def category_table(rows: list[dict]) -> str:
    """tau per prompt category (rows) and method (columns); empty when the prompts carry no categories."""
    rows = [r for r in rows if r["tau_by_category"]]
    cats = sorted({c for r in rows for c in r["tau_by_category"]})
    if not rows or cats == ["-"]:
        return ""
    head = "| category | " + " | ".join(r["method"] for r in rows) + " |\n|---|" + "---:|" * len(rows) + "\n"
    lines = [f"| {c} | " + " | ".join(_cell(".2f")(r["tau_by_category"].get(c)) for r in rows) + " |" for c in cats]
    return "\ntau by prompt category:\n\n" + head + "\n".join(lines) + "\n"


def write_plots(rows: list[dict], out_dir: Path, depth: int) -> list[Path]:
    """tau and speedup vs budget, per-depth acceptance, stage breakdown; none without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    tree_rows = [r for r in rows if r["method"] not in ("ar", "ar_stock")]
    sweep = sorted((r for r in tree_rows if r["builder"] == "best_first" and isinstance(r["budget"], int)),
                   key=lambda r: r["budget"])
    others = [r for r in tree_rows if r not in sweep]
    for key, label, fname in (("tau", "tau (tokens per round)", "tau_vs_budget.png"),
                              ("speedup", "speedup over ar", "speedup_vs_budget.png")):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        if sweep:
            ax.plot([r["budget"] for r in sweep], [r[key] for r in sweep], "o-", label="best_first")
        for r in others:
            if r["budget"] == "auto":
                ax.axhline(r[key], ls="--", color="C3", label=f"auto (mean budget {r['mean_budget']:.0f})")
            else:
                ax.plot([r["budget"]], [r[key]], "s", label=r["method"])
        if key == "speedup":
            ax.axhline(1.0, color="gray", lw=0.8, label="ar")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree budget (draft nodes)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out_dir / fname)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    for figure, name in ((depth_figure, "depth_acceptance.png"), (stage_figure, "stage_breakdown.png")):
        fig = figure(tree_rows)
        paths.append(out_dir / name)
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)
    return paths


def depth_figure(tree_rows: list[dict]):
    """P(round reaches depth d) per method, on whole-number depth ticks."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in tree_rows:
        if r["depth_acceptance"]:
            ax.plot(range(1, len(r["depth_acceptance"]) + 1), r["depth_acceptance"], marker=".", label=r["method"])
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("depth d")
    ax.set_ylabel("P(round reaches depth d)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return fig


def stage_figure(tree_rows: list[dict]):
    """Milliseconds per verify round by stage, one stacked bar per method, the legend beside the bars."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 0.8 + 0.28 * max(len(tree_rows), len(STAGES))))
    left = [0.0] * len(tree_rows)
    for i, stage in enumerate(STAGES):
        vals = [r["stage_ms_per_round"].get(stage, 0.0) for r in tree_rows]
        ax.barh([r["method"] for r in tree_rows], vals, left=left, label=stage, color=f"C{i}")
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("ms per verify round")
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def _meta(args, gen, prompts, seconds, argv, threads: ThreadInfo | None = None) -> dict:
    """The run's settings and machine; ``threads`` is what ``configure_threads`` chose (its source with it)."""
    import transformers

    cfg = gen.target.config
    return {
        "command": "python -m ddtree.bench " + " ".join(argv),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "machine": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "threads": (threads or thread_info()).as_dict(),
        "device": str(args.device),
        "dtype": str(next(gen.target.parameters()).dtype).replace("torch.", ""),
        "attention": gen.backend.name,
        "attention_requested": args.attention,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "target": args.target or f"default ({getattr(cfg, '_name_or_path', '')})",
        "drafter": args.drafter or "default (shipped)",
        "draft_depth": gen.drafter.block_size - 1,
        "cpu_linear_layers": cpu_linear.installed(gen.target),
        "draft_vocab": (None if getattr(gen.drafter, "draft_vocab", None) is None
                        else int(gen.drafter.draft_vocab.numel())),
        "prompts": str(args.prompts or DEFAULT_PROMPTS.name),
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "wall_seconds": round(seconds, 1),
        "data_parallel_ranks": distributed.world_size(),
    }


def _md_header(meta: dict) -> str:
    routed = meta.get("cpu_linear_layers")
    linears = f"ddtree.targets.cpu_linear on {routed} target linears" if routed else "stock linears"
    return (
        f"`{meta['command']}`\n\n{meta['machine']}, {meta['processor']}, {meta['device']} {meta['dtype']}, "
        f"torch {meta['torch']} ({meta['torch_threads']} threads), transformers {meta['transformers']}, "
        f"{linears}, tree attention {meta.get('attention', 'sdpa')}; "
        f"{meta['num_prompts']} prompts x {meta['max_new_tokens']} new tokens, temperature {meta['temperature']}, "
        f"{meta['repeats']} interleaved repeats, warm-up {meta.get('warmup', 'full')}, {meta['wall_seconds']} s.\n\n"
    )
