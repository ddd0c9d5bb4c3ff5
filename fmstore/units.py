"""Sizes and durations as users write them, parsed the same way in every flag and config key.

Sizes are binary: ``K``, ``KB``, ``KiB`` all mean 1,024 bytes (``M``: 2^20, ``G``: 2^30,
``T``: 2^40), as rclone and the aws cli read them, so ``--bwlimit 500MB`` on the command line
and ``bwlimit = "500M"`` in ``[daemon]`` are the same rate.  A trailing ``/s`` is allowed
(rates).  Durations: a number of seconds, or ``ms``, ``s``, ``m``, ``h``, ``d``, ``w``.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import ConfigError

_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(?:i?b)?(?:/s)?\s*", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_DURATION = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h|d|w)?\s*")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_size(value: Any, where: str) -> int:
    """Bytes from a positive number or a string like ``"100M"``, ``"1.5GiB"``,
    ``"64MB/s"``; :class:`ConfigError` naming ``where`` otherwise."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        n = float(value)
    elif isinstance(value, str) and (m := _SIZE.fullmatch(value)):
        n = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    else:
        raise ConfigError(
            f"{where}: {value!r} is not a size (bytes, or like 100M, 1.5GiB, 64MiB/s)"
        )
    if not n >= 1 or n != n or n == float("inf"):
        raise ConfigError(f"{where}: a size must be at least 1 byte, not {value!r}")
    return int(n)


def parse_duration(value: Any, where: str, *, allow_zero: bool = False) -> float:
    """Seconds from a positive number or a string like ``"90s"``, ``"30m"``, ``"2h"``,
    ``"7d"`` (``allow_zero``: 0 too); :class:`ConfigError` naming ``where`` otherwise."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.fullmatch(value)):
        seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2) or "s"]
    else:
        raise ConfigError(
            f"{where}: {value!r} is not a duration (seconds, or a string like '30m', '2h', '7d')"
        )
    if seconds == 0 and allow_zero:
        return 0.0
    if not seconds > 0 or seconds == float("inf"):
        raise ConfigError(f"{where}: duration must be positive, not {value!r}")
    return seconds


def human_bytes(n: float) -> str:
    """``1536`` → ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
