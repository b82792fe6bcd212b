"""``python -m ddtree demo|chat|doctor|bench|train``."""

from __future__ import annotations

import sys

USAGE = """usage: python -m ddtree COMMAND [options]

commands:
  demo    one prompt through plain decoding, the DFlash chain, DDTree (with and without a lookup branch)
          and the generator's defaults (default pair)
  chat    a multi-turn chat decoded by DDTree, streamed, with per-reply speed (default pair)
  doctor  why an engine's acceptance is low: config check, reference profile, fault signatures
  bench   benchmarks (python -m ddtree.bench --help)
  train   train a DFlash drafter (python -m ddtree.train --help)

Each command takes --help. Examples:
  python -m ddtree demo --budget 8
  python -m ddtree chat
  python -m ddtree doctor --engine-mean 1.04 --engine-rates 0.045,0.004,0,0,0
"""
EXAMPLES = [line.strip() for line in USAGE.split("Examples:")[1].splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from ddtree.apps.demo import main as demo_main

        return demo_main(rest)
    if command == "chat":
        from ddtree.apps.chat import main as chat_main

        return chat_main(rest)
    if command == "doctor":
        from ddtree.apps.doctor.command import main as doctor_main

        return doctor_main(rest)
    if command == "bench":
        from ddtree.bench.__main__ import exit_code
        from ddtree.bench.__main__ import main as bench_main

        return exit_code(bench_main(rest))
    if command == "train":
        from ddtree.train.__main__ import main as train_main

        return train_main(rest) or 0
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
