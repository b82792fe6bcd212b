"""``python -m ddtree demo``: one prompt through plain decoding, the DFlash chain, DDTree, DDTree
with a prompt-lookup branch in each tree, and the generator's defaults.

Prints the text once (checked identical across the five under greedy decoding),
then acceptance length, round cost, tokens/s and speedup per method with what each
means and why a method can be slower than plain decoding, and one round's tree
with its accepted branch and a legend of its marks.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

import torch

from ddtree.budget.decide import EXPLORE, FIRST, RETRY
from ddtree.generation.generator import GenerationOutput, SpeculativeGenerator
from ddtree.generation.stats import RoundRecord
from ddtree.runtime.threads import configure_threads

DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."


def render_tree(record: RoundRecord, decode, max_children: int = 3, max_depth: int = 5) -> str:
    """An indented picture of a tree: ``*`` marks the accepted branch, ``->`` the bonus token."""
    tree = record.tree
    accepted = set(record.accepted)
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents[0].tolist()):
        if p >= 0:
            kids.setdefault(p, []).append(i)
    toks, depths = tree.tokens[0].tolist(), tree.depths[0].tolist()
    lines: list[str] = []

    def visit(node: int, indent: str) -> None:
        mark = "*" if node in accepted else " "
        label = "root " if node == 0 else ""
        lines.append(f"{indent}{mark} {label}{decode(toks[node])!r}")
        children = kids.get(node, [])
        shown = [c for c in children if c in accepted] + [c for c in children if c not in accepted]
        if depths[node] >= max_depth:
            if children:
                lines.append(f"{indent}    ... {len(children)} more below")
            return
        for c in shown[:max_children]:
            visit(c, indent + "    ")
        if len(children) > max_children:
            lines.append(f"{indent}    ... {len(children) - max_children} more siblings")

    visit(0, "")
    lines.append(f"accepted {len(record.accepted) - 1} of {tree.budget} draft nodes, "
                 f"then bonus -> {decode(record.bonus)!r}")
    return "\n".join(textwrap.fill(line, 100, subsequent_indent="  ") for line in lines)


def _encode(tokenizer, prompt: str) -> torch.Tensor:
    if getattr(tokenizer, "chat_template", None):
        msgs = [{"role": "user", "content": prompt}]
        enc = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        return enc["input_ids"]
    return tokenizer(prompt, return_tensors="pt").input_ids


def run_demo(args: argparse.Namespace) -> int:
    dtype = getattr(torch, args.dtype)
    threads = configure_threads(args.threads, fix="python -m ddtree demo --threads 1, or OMP_NUM_THREADS=1")
    print(threads.describe(), flush=True)
    if (args.target is None) != (args.drafter is None):
        raise SystemExit("give --target and --drafter together (or neither, for the default pair)")
    print(f"loading {'the default pair' if args.target is None else args.target} ({args.dtype}) ...", flush=True)
    gen = SpeculativeGenerator.from_pretrained(args.target, args.drafter, dtype=dtype, attention=args.attention,
                                               prompt_lookup=False)
    tok = gen.tokenizer
    if tok is None:
        raise SystemExit(f"the target in {args.target} has no tokenizer (its directory lacks the tokenizer files, "
                         "e.g. tokenizer.json): the demo needs one")
    if gen.cpu_linear:
        print(f"target linears: ddtree.targets.cpu_linear ({gen.cpu_linear} layers; plain decoding uses it too)")
    ids = _encode(tok, args.prompt)
    if ids.shape[-1] == 0:
        raise SystemExit(
            f"the target's tokenizer encoded the prompt {args.prompt!r} to no tokens: the target directory "
            "probably lacks its tokenizer files (e.g. tokenizer.json); copy them there"
        )
    stop = [tok.eos_token_id] if tok.eos_token_id is not None else None
    depth = gen.drafter.block_size - 1
    # The fourth row adds a prompt-lookup branch to each tree (same budget): answers that repeat the
    # prompt or themselves are accepted further (see ddtree.drafters.lookup).
    merged = SpeculativeGenerator(gen.target, gen.drafter, tree_budget=args.budget, attention=gen.backend,
                                  prompt_lookup=True)
    default = SpeculativeGenerator(gen.target, gen.drafter, attention=gen.backend)  # what a user gets unless told
    methods = [("plain", gen, "best_first", 0), ("chain", gen, "chain", depth),
               (f"ddtree@{args.budget}", gen, "best_first", args.budget),
               (f"ddtree@{args.budget}+lookup", merged, "best_first", args.budget),
               ("default", default, "best_first", None)]
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, stop_token_ids=stop, seed=args.seed)
    # Warm up every path once so first-call costs do not land on one method.
    for _, g, builder, budget in methods:
        g.generate(ids, max_new_tokens=8, tree_budget=budget, builder=builder)
    outs: dict[str, GenerationOutput] = {}
    for name, g, builder, budget in methods:
        outs[name] = g.generate(ids, tree_budget=budget, builder=builder, record_trees=name == methods[2][0], **kwargs)
    texts = {n: tok.decode(o.new_tokens[0], skip_special_tokens=True) for n, o in outs.items()}
    plain = outs["plain"]
    print("\n" + "=" * 72)
    print(f"prompt: {args.prompt}\n")
    print(texts["plain"])
    print("=" * 72)
    same = all(torch.equal(o.sequences, plain.sequences) for o in outs.values())
    if args.temperature == 0:
        print(f"output identical for all {len(outs)} methods: " + ("yes" if same else "NO"))
    else:  # keyed draws: every method draws plain decoding's tokens for the seed
        print(f"temperature {args.temperature}, seed {args.seed}: the same sampled tokens for all {len(outs)} "
              "methods: " + ("yes" if same else "no (a tree forward and a one-token forward rounded a near-tie "
                             "apart; see the README)"))
        same = True  # the distribution is the target's either way
    print(f"\n{'method':<21}{'accept len':>11}{'round cost':>11}{'tokens/s':>11}{'speedup':>9}")
    for name, o in outs.items():
        tau = "-" if name == "plain" else f"{o.stats.mean_acceptance:.2f}"
        cost = "-" if name == "plain" else f"{round_cost(o, plain):.2f}"
        speed = o.stats.tokens_per_second / plain.stats.tokens_per_second
        print(f"{name:<21}{tau:>11}{cost:>11}{o.stats.tokens_per_second:>11.1f}{speed:>8.2f}x")
    print("\n" + explain_table({n: o for n, o in outs.items() if n != "plain"}, plain, depth, default))
    tree_run = outs[methods[2][0]]
    if tree_run.rounds:
        best = max(tree_run.rounds, key=lambda r: len(r.accepted))
        print(f"\none DDTree round (the longest accepted branch, root at position {best.start}; * = accepted by "
              "the target,\nno mark = drafted and rejected, -> = the bonus token the target's verify adds):")
        print(render_tree(best, lambda t: tok.decode([t])))
    return 0 if same else 1


def round_cost(out: GenerationOutput, plain: GenerationOutput) -> float:
    """Seconds per verify round of ``out``, in plain decoding's seconds per token."""
    per_token = plain.stats.total_seconds / max(1, plain.stats.new_tokens)
    return out.stats.total_seconds / max(1, out.stats.rounds) / per_token


def explain_table(runs: dict[str, GenerationOutput], plain: GenerationOutput, depth: int,
                  default: SpeculativeGenerator | None = None) -> str:
    """The table's columns and the rows' names, then why a method can lose: each round pays a drafter forward
    and a target forward over all its draft tokens, and wins only by accepting more tokens than that costs."""
    lines = [
        "accept len: tokens per verify round (the target's own bonus token included); round cost: a round's time "
        "in plain steps; speedup ~ accept len / round cost.",
        f"chain: DFlash's one path of {depth} draft tokens; ddtree@N: a tree of N draft nodes; +lookup: each tree "
        "also gets a branch copied from where the prompt or the answer so far repeats itself.",
    ]
    if default is not None:
        lookup = "with" if default.options.prompt_lookup else "without"
        budget = default.tree_budget
        how = ("each round a plain step or the tree size its measured costs make fastest, learned from the "
               "generator's own rounds" if budget == "auto" else f"{budget} draft nodes")
        lines.append(f"default: SpeculativeGenerator's own settings, tree_budget={budget!r} ({how}), {lookup} the "
                     "lookup branch.")
        run = runs.get("default")
        if budget == "auto" and run is not None and run.stats.budgets:
            lines.append(default_rounds(run))
    slow = {n: o for n, o in runs.items() if o.stats.tokens_per_second < plain.stats.tokens_per_second}
    if slow:
        name, o = min(slow.items(), key=lambda item: item[1].stats.tokens_per_second)
        lines.append(f"{name} is slower than plain here: {o.stats.mean_acceptance:.2f} tokens a round at "
                     f"{round_cost(o, plain):.2f} plain steps each.")
    lines.append("On a CPU a round (a drafter forward, then a target forward over every draft token) costs more "
                 "than a plain step, so a method wins only where it accepts more per round than that; on a GPU a "
                 "forward over a few dozen tokens costs about one step, and chains and trees gain close to their "
                 "accept len.")
    return "\n".join(textwrap.fill(line, 100, subsequent_indent="  ") for line in lines)


def default_rounds(run: GenerationOutput) -> str:
    """How ``"auto"`` spent the call's rounds: on a new generator it also measures the options it decides
    between, so one call can trail the best fixed tree."""
    budgets, reasons = run.stats.budgets, run.stats.reasons
    plain, tried = budgets.count(0), sum(r in (FIRST, EXPLORE, RETRY) for r in reasons)
    return (f"default's rounds here: {len(budgets) - plain} drafted, {plain} plain; {tried} of them measured an "
            "option it was not taking (a first measurement, a neighbouring tree size, a retry of plain or "
            "drafting). The generator is new (a short warm-up call before this one): its later calls start from "
            "what it measured.")


EXAMPLES = [
    "python -m ddtree demo",
    "python -m ddtree demo --budget 8 --max-new-tokens 64 --prompt 'Write a haiku about trees.'",
    "python -m ddtree demo --temperature 0.7 --seed 1",
]


def build_parser() -> argparse.ArgumentParser:
    from ddtree.apps.cli import parser

    ap = parser("python -m ddtree demo", __doc__, EXAMPLES)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message (sent through the chat template)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0 = greedy (every method's output must match plain decoding)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per method")
    ap.add_argument("--budget", type=int, default=4, help="DDTree node budget (4 is the fastest on a 2-core CPU)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype")
    ap.add_argument("--attention", default="auto", help="tree attention backend (sdpa, split, fused, auto)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (None: OMP_NUM_THREADS, else the free physical cores)")
    ap.add_argument("--target", default=None, help="target model directory (None: the default SmolLM2 pair)")
    ap.add_argument("--drafter", default=None, help="DFlash drafter directory for --target")
    return ap


def main(argv: list[str] | None = None) -> int:
    return run_demo(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
