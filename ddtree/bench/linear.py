"""Per-round verify cost through a hybrid GDN target: a tree against a chain, and against its paths one by one.

``python -m ddtree.bench linear`` builds a Qwen3.5-style hybrid (3 GDN : 1 attention
layers, random weights), prefills a context and times, per case:

- ``tree_ms``: ddtree's verify forward of a random tree of N nodes (root included);
- ``chain_ms``: ddtree's verify forward of an N-node chain (the DFlash case);
- ``plain_ms``: transformers' own forward of the same N tokens continuing the cache
  (what a chain verify costs without ddtree);
- ``paths_ms``: the tree's root-to-leaf paths run one by one as plain forwards;
- ``commit_ms``: ``commit_accepted`` of the tree's deepest path (the GDN replay).

Each figure is the least disturbed of ``--repeats`` runs, the cases taking turns.

The goal is ``tree_ms <= 1.5 x chain_ms``. ``--preset qwen36-27b`` uses the widths of
one Qwen3.6-27B layer stack (hidden 5120, 48 value heads, Dk = Dv = 128), for a GPU.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from ddtree.bench.attention import DTYPES, parse_sizes, random_tree, write_result
from ddtree.core.masks import tree_position_ids
from ddtree.core.tree import DraftTree
from ddtree.targets.backends import get_backend
from ddtree.targets.cache import (
    cache_kwargs,
    commit_accepted,
    new_target_cache,
    truncate,
)

PRESETS = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32),
    "qwen36-27b": dict(hidden_size=5120, intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4,
                       head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                       linear_value_head_dim=128),
}


def hybrid_target(preset: str = "tiny", layers: int = 4, *, vocab: int = 1024, dtype=torch.float32, device="cpu",
                  seed: int = 0):
    """A random Qwen3.5-style hybrid: every 4th layer full attention, the others GDN."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    for model_type in ("qwen3_5_text", "qwen3_next"):
        if model_type in CONFIG_MAPPING:
            break
    else:
        raise SystemExit("this transformers has neither qwen3_5 nor qwen3_next: install transformers>=5.0")
    extra = {} if model_type == "qwen3_5_text" else dict(num_experts=0, decoder_sparse_step=0)
    torch.manual_seed(seed)
    config = CONFIG_MAPPING[model_type](
        vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=1 << 17,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        **PRESETS[preset], **extra,
    )
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _timed(cases: dict, repeats: int, sync) -> dict[str, float]:
    """Least-disturbed milliseconds per case. ``cases`` maps a name to ``setup() -> run``; only ``run`` is
    timed. The cases take turns within each repeat, so a burst of load elsewhere hits them all alike."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(repeats + 1):
        for name, setup in cases.items():
            run = setup()
            sync()
            t0 = time.perf_counter()
            run()
            sync()
            if i:  # the first round pays one-off allocations
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: min(ts) for name, ts in times.items()}


def _leaf_paths(tree: DraftTree) -> list[list[int]]:
    parents = tree.parents[0].tolist()
    leaves = set(range(len(parents))) - set(parents)
    paths = []
    for leaf in sorted(leaves):
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    return paths


@torch.inference_mode()
def bench_case(model, context: int, nodes: int, *, repeats: int = 5, attention: str = "sdpa", seed: int = 0) -> dict:
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    vocab = model.get_input_embeddings().weight.shape[0]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(seed)
    backend = get_backend(attention)
    backend.prepare(model)
    base = new_target_cache(model)
    model(torch.randint(0, vocab, (1, context), generator=gen).to(device), use_cache=True, **cache_kwargs(model, base))
    shape = random_tree(nodes, 15, gen)
    tokens = torch.randint(0, vocab, (1, nodes), generator=gen)
    tree = DraftTree.from_parents(tokens.to(device), shape.parents.to(device))
    chain = DraftTree.from_parents(tokens.to(device), torch.arange(-1, nodes - 1, device=device)[None])

    def verify(t: DraftTree, cache):
        kw = backend.tree_forward_kwargs(model, t, context, dtype)
        model(t.tokens, position_ids=tree_position_ids(t.depths, context), use_cache=True,
              **cache_kwargs(model, cache), **kw)

    def reset():
        truncate(base, context)  # drop the previous verify's nodes: back to the prefix

    def ddtree_verify(t):
        def setup():
            reset()
            return lambda: verify(t, base)
        return setup

    def plain(token_lists):
        def setup():
            caches = [copy.deepcopy(base) for _ in token_lists]
            ids = [torch.tensor([toks], device=device) for toks in token_lists]
            return lambda: [model(i, use_cache=True, **cache_kwargs(model, c)) for i, c in zip(ids, caches)]
        return setup

    paths = _leaf_paths(tree)
    deepest = max(paths, key=len)

    def commit_setup():
        reset()
        snapshot = copy.deepcopy(base)
        verify(tree, snapshot)
        return lambda: commit_accepted(snapshot, context, torch.tensor([deepest], device=device))

    timed = _timed({"tree_ms": ddtree_verify(tree), "chain_ms": ddtree_verify(chain),
                    "plain_ms": plain([tokens[0].tolist()]),
                    "paths_ms": plain([tokens[0, p].tolist() for p in paths]), "commit_ms": commit_setup},
                   repeats, sync)
    row = dict(context=context, nodes=nodes, depth=tree.max_depth, leaves=len(paths), **timed)
    row["tree_over_chain"] = row["tree_ms"] / row["chain_ms"]
    return row


def format_table(rows: list[dict]) -> str:
    lines = ["| context | nodes | depth | leaves | tree ms | chain ms | plain chain ms | paths one by one ms | "
             "commit ms | tree / chain |", "| " + " | ".join(["---"] * 10) + " |"]
    for r in rows:
        lines.append(f"| {r['context']} | {r['nodes']} | {r['depth']} | {r['leaves']} | {r['tree_ms']:.2f} | "
                     f"{r['chain_ms']:.2f} | {r['plain_ms']:.2f} | {r['paths_ms']:.2f} | {r['commit_ms']:.2f} | "
                     f"{r['tree_over_chain']:.2f}x |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ddtree.bench linear", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=4, help="decoder layers (every 4th is full attention)")
    p.add_argument("--contexts", default="256,1k")
    p.add_argument("--nodes", default="16,64")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    p.add_argument("--attention", default="sdpa")
    p.add_argument("--out", default=None)
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = hybrid_target(args.preset, args.layers, dtype=DTYPES[args.dtype], device=device)
    rows = []
    for context in parse_sizes(args.contexts):
        for nodes in parse_sizes(args.nodes):
            rows.append(bench_case(model, context, nodes, repeats=args.repeats, attention=args.attention))
            print(format_table(rows[-1:]).split("\n", 2)[-1], flush=True)
    print(format_table(rows))
    result = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "torch": torch.__version__,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "rows": rows}
    write_result(result, args.out, "linear_bench.json")
    return result


if __name__ == "__main__":
    main()
