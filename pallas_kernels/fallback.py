"""Where an "auto" implementation takes the XLA path instead of a kernel, it says so: once
per reason (operation and shapes), as a logging warning of this module's logger
(`pallas_kernels.fallback`), so a model whose shapes the kernels do not take is never slow
without a word."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)
_said: set[str] = set()


def log_once(operation: str, reason: str) -> bool:
    """Warn "<operation>: the XLA path, not the kernels: <reason>" the first time this
    (operation, reason) comes; True when it was logged now."""
    message = f"{operation}: the XLA path, not the kernels: {reason}"
    if message in _said:
        return False
    _said.add(message)
    logger.warning(message)
    return True
