"""What ddtree says while it works: the standard ``logging`` logger ``"ddtree"``, shown on stderr by default.

Long one-time work (compiling the static round under ``compile=True``) says what it does and how long it took,
so minutes of silence do not read as a hang. Its lines print as ``[ddtree] ...`` on stderr at INFO, unless the
application handles logging itself (a handler on the root logger: the records go there instead). Quiet::

    import logging
    logging.getLogger("ddtree").setLevel(logging.WARNING)
"""

from __future__ import annotations

import logging
import sys

NAME = "ddtree"


class _Stderr(logging.Handler):
    """Writes to the current ``sys.stderr`` while the root logger has no handler (an application that added one
    gets the records through it, once)."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        try:
            sys.stderr.write(f"[ddtree] {self.format(record)}\n")
            sys.stderr.flush()
        except Exception:  # a closed stream must not break decoding
            self.handleError(record)


def logger() -> logging.Logger:
    """The ``ddtree`` logger, given the stderr handler and INFO level the first time (a level the application
    set is kept)."""
    log = logging.getLogger(NAME)
    if not any(isinstance(h, _Stderr) for h in log.handlers):
        if log.level == logging.NOTSET:
            log.setLevel(logging.INFO)
        log.addHandler(_Stderr())
    return log
