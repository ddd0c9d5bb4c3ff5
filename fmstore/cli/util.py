"""Helpers shared by the commands."""

from __future__ import annotations

import os
import re

import typer

from ..errors import ConfigError
from ..stores import split_tier
from ..units import human_bytes, parse_size

__all__ = ["human_bytes", "plural", "printable", "is_root", "size_option", "split_object"]

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _visible(c: str) -> str:
    o = ord(c)
    return _NAMED.get(c) or (
        f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"
    )


def printable(name: object, *, markup: bool = True) -> str:
    """``name`` (a key, a file or tensor name, a problem quoting one: anything from data) as
    the terminal may show it: every character Python does not call printable (C0 and C1
    controls, DEL, the bidirectional overrides and isolates, other format characters, line
    and paragraph separators) as a visible escape (``\\x1b``, ``\\r``, ``\\u202e``), so no
    name can hide itself, retitle the terminal or fake a line; and, for output rich reads
    as markup (``markup``, the default), rich's markup escaped (``[/]`` is text)."""
    text = str(name)
    if not text.isprintable():
        text = "".join(c if c.isprintable() else _visible(c) for c in text)
    if markup:
        from rich.markup import escape  # on demand, like the consoles

        text = escape(text)
    return text


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
