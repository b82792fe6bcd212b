"""``python -m ddtree.bench SUBCOMMAND ...``: ``attention`` runs the attention micro-benchmark, ``linear`` the
GDN-hybrid verify benchmark; anything else goes to the main bench."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "attention":
        from .attention import main as attention_main

        return attention_main(argv[1:])
    if argv and argv[0] == "linear":
        from .linear import main as linear_main

        return linear_main(argv[1:])
    try:
        from .runner import run_main_bench
    except ImportError as exc:
        raise SystemExit(
            f"the main benchmark (ddtree.bench.runner) is not available yet ({exc}); "
            "try `python -m ddtree.bench attention --help`"
        ) from exc
    return run_main_bench(argv)


def exit_code(result) -> int:
    """``main``'s result as a process exit status (the attention bench returns its results dict)."""
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(exit_code(main()))
