"""What the package tells a user by default, through the standard ``logging`` module.

Every module logs under ``accordion_hvd.*`` and the application's logging configuration
decides what is shown, as for any library. One kind of line is worth seeing even when the
application configured no logging at all: a change of compression level (on rank 0 only),
under the logger ``accordion_hvd.levels``. ``announce`` sends it through ``logging`` at INFO
as usual; when logging is not configured (no handler on the root logger and no level set on
ours), Python would drop an INFO line, so it goes to stderr instead, as Python's own
"last resort" handler does for warnings. Silence it with
``logging.getLogger("accordion_hvd.levels").setLevel(logging.WARNING)``.
"""

from __future__ import annotations

import logging
import sys

LEVELS_LOGGER = "accordion_hvd.levels"
levels_log = logging.getLogger(LEVELS_LOGGER)


def announce(logger: logging.Logger, message: str, *args) -> None:
    """``logger.info(message, *args)``, shown on stderr when logging is not configured."""
    if logger.isEnabledFor(logging.INFO):
        logger.info(message, *args)
    elif not logging.getLogger().handlers and _unset(logger):
        sys.stderr.write(f"{logger.name}: {message % args if args else message}\n")


def _unset(logger: logging.Logger) -> bool:
    """No level set on the logger or on any of its parents below the root."""
    while logger is not None and logger.parent is not None:
        if logger.level != logging.NOTSET:
            return False
        logger = logger.parent
    return True
