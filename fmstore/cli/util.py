"""Helpers shared by the commands."""

from __future__ import annotations

import typer

from ..errors import ConfigError
from ..units import human_bytes, parse_size

__all__ = ["human_bytes", "plural", "size_option"]


def size_option(text: str, what: str) -> int:
    """A size given on the command line (:func:`fmstore.units.parse_size`); a bad one is a
    usage error naming the option."""
    try:
        return parse_size(text, what)
    except ConfigError as e:
        raise typer.BadParameter(e.message.split(": ", 1)[-1], param_hint=what) from None


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 file``, ``2 files``, ``0 files``; ``many`` for irregular plurals (``directories``)."""
    return f"{n} {word if n == 1 else (many or word + 's')}"
