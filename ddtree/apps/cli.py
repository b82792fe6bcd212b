"""What every ddtree command line shares: help that shows defaults, and examples kept in one list.

Each command keeps its examples in an ``EXAMPLES`` list; the ``--help`` epilog
is made from it and ``tests/test_cli_help.py`` runs every entry in a short
form, so an example in a help text cannot go stale.
"""

from __future__ import annotations

import argparse
import re


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows ``(default: ...)`` after every option's help and keeps the description's line breaks."""


def plain(doc: str | None) -> str:
    """A docstring as terminal text: reST double backticks and ``:func:`` roles dropped."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc or "")
    return text.replace("``", "")


def epilog(examples: list[str]) -> str:
    return "examples:\n" + "\n".join(f"  {e}" for e in examples)


def parser(prog: str, description: str | None, examples: list[str] | None = None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=plain(description), formatter_class=HelpFormatter,
                                   epilog=epilog(examples) if examples else None)
