"""The bench's subcommands: the module whose ``main(argv)`` runs each, and what it measures."""

SUBCOMMANDS = {
    # name: (module with main(argv), what it measures)
    "tree-build": ("ddtree.bench.tree_build", "tree construction: the vectorised best_first against a heap loop"),
    "cpu-linear": ("ddtree.bench.cpu_linear", "the few-row CPU linear kernel against BLAS on a layer stack"),
    "attention": ("ddtree.bench.attention", "one tree-verify attention layer per backend"),
    "long-run": ("ddtree.bench.long_run", "one long generation: exactness and memory per committed token"),
    "linear": ("ddtree.bench.linear", "hybrid GDN verify: tree against chain"),
    "dflash2": ("ddtree.bench.dflash2", "DDTree over a DFlash2 selector's pairwise scores against its chain"),
    "hostreads": ("ddtree.bench.host_reads", "host reads per round (each a device wait on a GPU) by method and batch"),
    "compiled": ("ddtree.bench.compiled", "the dynamic round against compile=True, per method"),
    "eager-regression": ("ddtree.bench.eager_regression",
                         "the eager path's tokens/s against another source tree's, in alternating processes"),
    "numerics": ("ddtree.bench.numerics", "numerics='exact' against 'fast': tokens/s, and rows that fork from plain"),
    "engines": ("ddtree.bench.engines", "ddtree against vLLM (optional peer in its own venv): tokens/s, equal outputs"),
    "step-split": ("ddtree.bench.step_split",
                   "a decoding step's milliseconds: linear, attention, the rest; ddtree's beside vLLM's"),
    "memory": ("ddtree.bench.memory", "long prompts: peak memory and time to first token against HF generate"),
}
