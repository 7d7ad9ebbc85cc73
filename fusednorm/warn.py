"""One-time warnings: the same reason is said once per process, not once per call."""
from __future__ import annotations

import warnings

_said: set[str] = set()


class FusedNormWarning(UserWarning):
    pass


def warn_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        warnings.warn(message, FusedNormWarning, stacklevel=3)
