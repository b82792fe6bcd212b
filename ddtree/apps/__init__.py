"""Command-line programs: ``python -m ddtree demo`` and ``chat``, and their shared argument parser."""
