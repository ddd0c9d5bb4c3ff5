"""Helpers shared by the commands."""

from __future__ import annotations

import os
import re

import typer

from ..errors import ConfigError
from ..stores import split_tier
from ..units import human_bytes, parse_size

__all__ = ["human_bytes", "plural", "is_root", "size_option", "split_object"]


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


def split_object(url: str) -> tuple[str, str]:
    """``s3://b/p/k`` → ``("s3://b/p", "k")``; ``nvme:a/k`` → ``("nvme:a", "k")``; paths too."""
    tier, rest = split_tier(url)
    if tier is not None:
        head, _, tail = rest.rstrip("/").rpartition("/")
        if not tail:
            raise ConfigError(f"{url!r} names a tier root, not an object")
        return f"{tier}:{head}", tail
    m = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)(.*)$", url)
    if m and m.group(1).lower() != "file://":
        scheme, rest = m.groups()
        head, sep, tail = rest.rstrip("/").rpartition("/")
        if not sep or not tail:
            raise ConfigError(f"{url!r} names a bucket, not an object")
        return scheme + head, tail
    path = os.path.abspath(os.path.expanduser(url[len("file://") :] if m else url))
    return os.path.dirname(path), os.path.basename(path)


def is_root(url: str) -> bool:
    """Whether ``url`` is a tier's root or a bucket (empty there is not missing)."""
    tier, rest = split_tier(url)
    if tier is not None:
        return not rest.strip("/")
    m = re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://[^/]*/?(.*)$", url)
    return m is not None and not m.group(1).strip("/")
