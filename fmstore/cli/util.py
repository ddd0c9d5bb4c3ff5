"""Helpers shared by the commands."""

from __future__ import annotations

import typer

from ..errors import ConfigError
from ..units import human_bytes, parse_size

__all__ = ["human_bytes", "size_option"]


def size_option(text: str, what: str) -> int:
    """A size given on the command line (:func:`fmstore.units.parse_size`); a bad one is a
    usage error naming the option."""
    try:
        return parse_size(text, what)
    except ConfigError as e:
        raise typer.BadParameter(e.message.split(": ", 1)[-1], param_hint=what) from None
