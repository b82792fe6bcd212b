"""``python -m ddtree.bench [SUBCOMMAND] ...``: one table of subcommands; no subcommand runs the main bench
(``ddtree.bench.main``: methods over a prompt set)."""

from __future__ import annotations

import importlib
import sys

from ddtree.bench.commands import SUBCOMMANDS


def main(argv: list[str] | None = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return importlib.import_module(SUBCOMMANDS[argv[0]][0]).main(argv[1:])
    from ddtree.bench.main import run_main_bench

    return run_main_bench(argv)


def exit_code(result) -> int:
    """``main``'s result as a process exit status (the attention bench returns its results dict)."""
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(exit_code(main()))
