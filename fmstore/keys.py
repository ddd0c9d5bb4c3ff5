"""Key validation, done once, centrally.

A key is a relative, ``/``-separated path.  Every store validates keys with
:func:`validate_key` before touching storage, so no key can escape its tier's root:
absolute paths, ``.``/``..`` segments, empty segments, NUL and control characters,
backslashes and over-long keys are refused.
"""

from __future__ import annotations

import re

from .errors import InvalidKey

#: S3's limit on key length, in UTF-8 bytes; POSIX stores keep the same limit so that
#: every key can be copied to every tier.
MAX_KEY_BYTES = 1024
#: Most POSIX file systems limit one path component to 255 bytes.
MAX_SEGMENT_BYTES = 255


def validate_key(key: object, *, tier: str | None = None) -> str:
    """Return ``key`` unchanged if it is a safe relative key, else raise :class:`InvalidKey`."""
    if not isinstance(key, str):
        raise InvalidKey(f"key must be a str, not {type(key).__name__}", tier=tier)
    if not key:
        raise InvalidKey("key is empty", tier=tier, key=key)
    _check_chars(key, tier)
    if key.startswith("/"):
        raise InvalidKey("key must be relative, not absolute", tier=tier, key=key)
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        raise InvalidKey(f"key is longer than {MAX_KEY_BYTES} bytes", tier=tier, key=key)
    for seg in key.split("/"):
        _check_segment(seg, key, tier)
    return key


def validate_prefix(prefix: object, *, tier: str | None = None) -> str:
    """Validate a listing prefix: ``""`` (everything) or a key, optionally ending in ``/``.

    Returns the prefix normalised to end with ``/`` (or ``""``): prefixes name directories,
    so ``"ckpt/step1"`` never matches ``"ckpt/step10/..."``.
    """
    if prefix is None or prefix == "":
        return ""
    if not isinstance(prefix, str):
        raise InvalidKey(f"prefix must be a str, not {type(prefix).__name__}", tier=tier)
    validate_key(prefix.rstrip("/") or "/", tier=tier)
    return prefix.rstrip("/") + "/"


def join(*parts: str) -> str:
    """Join key parts with ``/``, skipping empty parts; the result is validated."""
    key = "/".join(p.strip("/") for p in parts if p and p.strip("/"))
    return validate_key(key)


#: Any character a key may not hold (one C-level scan; the loop below names which).
_BAD_CHAR = re.compile(r"[\x00-\x1f\x7f\\\ud800-\udfff]")


def _check_chars(key: str, tier: str | None) -> None:
    bad = _BAD_CHAR.search(key)
    if bad is None:
        return
    for ch in key[bad.start() :]:
        if ch == "\x00":
            raise InvalidKey("key contains a NUL byte", tier=tier, key=key)
        if ord(ch) < 0x20 or ch == "\x7f":
            raise InvalidKey(f"key contains control character {ch!r}", tier=tier, key=key)
        if ch == "\\":
            raise InvalidKey("key contains a backslash", tier=tier, key=key)
        if 0xD800 <= ord(ch) <= 0xDFFF:
            raise InvalidKey("key contains a lone surrogate", tier=tier, key=key)


def _check_segment(seg: str, key: str, tier: str | None) -> None:
    if seg == "":
        raise InvalidKey("key has an empty segment ('//' or a trailing '/')", tier=tier, key=key)
    if seg in (".", ".."):
        raise InvalidKey(f"key has a {seg!r} segment", tier=tier, key=key)
    if len(seg.encode("utf-8")) > MAX_SEGMENT_BYTES:
        raise InvalidKey(
            f"a key segment is longer than {MAX_SEGMENT_BYTES} bytes", tier=tier, key=key
        )


#: The one field of a step pattern: ``{step}`` (decimal, no padding) or ``{step:0Nd}``
#: (zero-padded to N digits, like Megatron's ``iter_{step:07d}``).
_STEP_FIELD = re.compile(r"\{step(?::0([1-9][0-9]?)d)?\}")
_GLOB = "*?[]"


class StepPattern:
    """How a run root names its step directories: ``prefix``, the step in decimal (at
    least ``width`` digits, zero-padded), ``suffix``.  ``step-{step}`` is torchtitan's,
    ``checkpoint-{step}`` the Hugging Face Trainer's.  Names round-trip: a name counts only
    when :meth:`name` of its step spells it exactly (``step-04`` is not step 4's), so each
    step has one key on every tier."""

    def __init__(self, text: object) -> None:
        """Raises ValueError saying what is wrong with ``text``."""
        if not isinstance(text, str):
            raise ValueError(f"a step pattern is a string, not {type(text).__name__}")
        fields = list(_STEP_FIELD.finditer(text))
        if len(fields) != 1:
            other = re.search(r"\{[^{}]*\}", text) if not fields else None
            raise ValueError(
                (
                    f"{other.group(0)!r} in {text!r} is not a step field"
                    if other
                    else f"{text!r} holds {len(fields) or 'no'} {{step}} field{'s' * (len(fields) > 1)}"
                )
                + '; a pattern holds exactly one, {step} or {step:0Nd}, like "step-{step}" or '
                '"iter_{step:07d}"'
            )
        f = fields[0]
        self.text = text
        self.prefix, self.suffix = text[: f.start()], text[f.end() :]
        self.width = int(f.group(1) or 0)
        rest = self.prefix + self.suffix
        for ch in "{}":
            if ch in rest:
                raise ValueError(
                    f"{text!r} holds {ch!r} outside its {{step}} field (the field is "
                    "{step} or {step:0Nd}, nothing else)"
                )
        if "/" in rest:
            raise ValueError(f"{text!r} holds '/': a step is one directory below its run root")
        if ".." in rest or rest.startswith("."):
            raise ValueError(
                f"{text!r} holds '..' or starts with '.': a step's name is never hidden and "
                "never leaves its run root"
            )
        if glob := [c for c in _GLOB if c in rest]:
            raise ValueError(
                f"{text!r} holds the glob character {glob[0]!r}: a pattern spells names, "
                "it does not match them by wildcard"
            )
        if _BAD_CHAR.search(rest):
            raise ValueError(f"{text!r} holds a control character or a backslash")
        if len(rest.encode("utf-8")) + max(self.width, 20) > MAX_SEGMENT_BYTES:
            raise ValueError(f"{text!r} is too long for a directory name")

    def name(self, step: int) -> str:
        return f"{self.prefix}{step:0{self.width}d}{self.suffix}"

    def step(self, name: str) -> int | None:
        """The step ``name`` spells (a trailing ``/`` ignored), or None."""
        name = name.rstrip("/")
        if len(name) <= len(self.prefix) + len(self.suffix):
            return None
        if not (name.startswith(self.prefix) and name.endswith(self.suffix)):
            return None
        digits = name[len(self.prefix) : len(name) - len(self.suffix)]
        if not (digits.isascii() and digits.isdigit()):
            return None
        step = int(digits)
        return step if self.name(step) == name else None

    def __repr__(self) -> str:
        return f"StepPattern({self.text!r})"
