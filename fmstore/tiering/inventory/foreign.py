"""Checkpoints on the tiers that fmstore does not count, and why; the step names it counts.

A run root's steps are ``step_NNNNNNNNNNNN`` directories, or, where the root declares one
(``[runs."ROOT"] step_pattern``), directories named by its pattern.  Anything else that
looks like a checkpoint is never tiered, and a scan says so rather than finding nothing:
torchtitan's ``step-4``, the Hugging Face Trainer's ``checkpoint-500``, Lightning's
``epoch=1-step=4.ckpt``, Megatron's ``iter_0000004``, DeepSpeed's ``global_step4``, a
native DCP directory (``.metadata`` beside ``*.distcp``), a bare ``*.pt`` or
``*.safetensors`` file, an fmstore checkpoint under a name that is not a step.

What is said is bounded, whatever a tier holds: :class:`NotCounted` lists at most
:data:`PER_ROOT` entries under each prefix and :data:`MAX_ROOTS` prefixes, and counts the
rest.  Telling what a foreign-named directory holds costs one listing of it, made for the
entries listed only; the others are counted by their name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ... import keys as _keys
from ...checkpoint.layout import parse_step
from ...config import Config
from ...errors import ConfigError, NotFound
from ...format.manifest import MANIFEST_KEY
from ...keys import StepPattern
from ...protocol.skew import InFuture
from ...stores.base import Store

#: Entries listed under one prefix, and prefixes listed, per scan; the rest are counted.
PER_ROOT = 10
MAX_ROOTS = 50

#: What torch's own ``FileSystemWriter`` writes last: a native DCP checkpoint's commit.
DCP_METADATA = ".metadata"

DCP = (
    "a native DCP checkpoint (.metadata), not an fmstore one: never tiered; save it "
    "through fmstore.checkpoint.dcp"
)
_LIGHTNING = "save it through fmstore.integrations.lightning (FmstoreCheckpointIO)"
_BARE = "never tiered; save it with fmstore.save or a CheckpointManager"

#: Directory names of the stacks' own checkpoints: (pattern, whose, where to save instead).
_DIR_NAMES: tuple[tuple[re.Pattern[str], str, str], ...] = (
    (re.compile(r"step-[0-9]+\Z"), "torchtitan's", "fmstore.integrations.torchtitan"),
    (
        re.compile(r"checkpoint-[0-9]+\Z"),
        "the Hugging Face Trainer's",
        "fmstore.integrations.hf.FmstoreCallback",
    ),
    (re.compile(r".+\.ckpt\Z"), "Lightning's", "fmstore.integrations.lightning"),
    (re.compile(r"iter_[0-9]{7}\Z"), "Megatron's", "fmstore.checkpoint.dcp"),
    (re.compile(r"global_step[0-9]+\Z"), "DeepSpeed's", "fmstore.checkpoint.dcp"),
)
#: File names fmstore never wrote as a checkpoint: suffix -> what it is.
_FILES = {
    ".ckpt": f"a Lightning checkpoint file (torch.save), not an fmstore one: never tiered; {_LIGHTNING}",
    ".pt": f"a bare torch.save file, not an fmstore checkpoint: {_BARE}",
    ".pth": f"a bare torch.save file, not an fmstore checkpoint: {_BARE}",
    ".safetensors": f"a bare safetensors file, not an fmstore checkpoint: {_BARE}",
}

#: ``step_of(name)``: the step a directory name spells under one run root, or None.
StepOf = Callable[[str], int | None]


def step_patterns(config: Config) -> dict[str, StepPattern]:
    """Run root -> the step pattern it declares (``[runs."ROOT"] step_pattern``, checked
    when the config was read); roots not named there use ``step_NNNNNNNNNNNN``."""
    out = {}
    for root, table in config.section("runs").items():
        if isinstance(table, Mapping) and "step_pattern" in table:
            try:
                out[root.strip("/")] = StepPattern(table["step_pattern"])
            except ValueError as e:  # a Config built without from_dict
                raise ConfigError(f'{config.origin}: [runs."{root}"] step_pattern: {e}') from None
    return out


def step_key(patterns: dict[str, StepPattern], root: str, step: int) -> str:
    """The key of checkpoint ``(root, step)``: its root's pattern, else ``step_…``."""
    p = patterns.get(root.strip("/"))
    if p is None:
        from ...checkpoint.layout import checkpoint_key

        return checkpoint_key(root, step)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"a checkpoint step must be a whole number >= 0, not {step!r}")
    return _keys.join(root, p.name(step))


def step_parser(patterns: dict[str, StepPattern], root: str) -> StepOf:
    """How step directories under ``root`` are named: its pattern, else ``step_…``."""
    p = patterns.get(root.strip("/"))
    return parse_step if p is None else p.step


def suggest_pattern(name: str) -> str | None:
    """``step-4`` -> ``step-{step}``: the name with its last run of digits as the field,
    when that makes a valid pattern."""
    m = re.search(r"[0-9]+(?=[^0-9]*\Z)", name)
    if m is None:
        return None
    text = f"{name[: m.start()]}{{step}}{name[m.end() :]}"
    try:
        StepPattern(text)
    except ValueError:
        return None
    return text


#: Manifests created in the future listed per scan (the rest are counted).
MAX_FUTURE = 1000


@dataclass
class NotCounted:
    """What a scan found and does not count, by the prefix it lies under (``tier:key``):
    at most ``per_root`` entries (URL -> why) under each of at most ``max_roots`` prefixes;
    ``more``: how many more each prefix holds (a prefix beyond ``max_roots`` counts under
    its tier, ``tier:``)."""

    per_root: int = PER_ROOT
    max_roots: int = MAX_ROOTS
    by_root: dict[str, dict[str, str]] = field(default_factory=dict)
    more: dict[str, int] = field(default_factory=dict)
    #: steps not counted because their manifests were created in the future (every one
    #: up to :data:`MAX_FUTURE`, whatever ``per_root`` lists); ``future_more``: the rest
    future: list[InFuture] = field(default_factory=list)
    future_more: int = 0

    def add_future(self, f: InFuture) -> None:
        """Note ``f`` among the manifests created in the future (said apart from the other
        entries, at warning on every scan: :mod:`.skew`)."""
        if len(self.future) < MAX_FUTURE:
            self.future.append(f)
        else:
            self.future_more += 1

    def room(self, root: str) -> bool:
        """Whether one more entry under ``root`` would be listed."""
        listed = self.by_root.get(root)
        if listed is None:
            return len(self.by_root) < self.max_roots
        return len(listed) < self.per_root

    def add(self, root: str, url: str, why: str) -> None:
        if url in self.by_root.get(root, ()):
            self.by_root[root][url] = why[:300]
        elif self.room(root):
            self.by_root.setdefault(root, {})[url] = why[:300]
        else:
            self.skip(root)

    def skip(self, root: str, n: int = 1) -> None:
        """``n`` more entries under ``root``, counted, not listed."""
        if root not in self.by_root:
            root = root.split(":", 1)[0] + ":"
        self.more[root] = self.more.get(root, 0) + n

    def flat(self) -> dict[str, str]:
        return {u: w for listed in self.by_root.values() for u, w in listed.items()}

    def roots(self) -> list[str]:
        """Every prefix with something noted, listed or only counted."""
        return sorted({*self.by_root, *self.more})

    def describe(self, root: str) -> str:
        """One line of what is noted under ``root``: each entry listed and why, then how
        many more there are."""
        listed = self.by_root.get(root, {})
        more = self.more.get(root, 0)
        n = len(listed) + more
        head = f"{root}: {n} entr{'y' if n == 1 else 'ies'} not counted as checkpoints"
        if not listed:
            return f"{head} (beyond the {self.max_roots} prefixes listed)"
        body = "; ".join(f"{url}: {why}" for url, why in listed.items())
        return f"{head}: {body}" + (f"; and {more} more not listed" if more else "")


@dataclass
class Look:
    """What one listing of a prefix shows: its step directories and its other directories
    (where run roots may lie deeper)."""

    steps: list[int] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)


async def _markers(store: Store, prefix: str) -> tuple[set[str], bool]:
    """Which of ``manifest.json`` and ``.metadata`` the directory ``prefix`` holds, and
    whether it holds directories (not hidden ones)."""
    found: set[str] = set()
    dirs = False
    try:
        async for meta in store.list(prefix, recursive=False):
            name = meta.key[len(prefix) :]
            if not meta.is_dir and name in (MANIFEST_KEY, DCP_METADATA):
                found.add(name)
            dirs = dirs or (meta.is_dir and not name.startswith("."))
    except NotFound:
        pass
    return found, dirs


def _named(name: str, root: str, declared: StepPattern | None) -> str:
    """Why an fmstore checkpoint (a ``manifest.json``) named ``name`` under ``root`` does
    not count, and what would count it."""
    if declared is not None:
        return (
            f"an fmstore checkpoint named {name!r}, not {declared.text!r} (the step_pattern "
            f"run root {root!r} declares): not tiered"
        )
    if (p := suggest_pattern(name)) is not None and not name.endswith(".ckpt"):
        return (
            f'named {name!r}, not step_NNNNNNNNNNNN: declare step_pattern = "{p}" for this '
            f'run root ([runs."{root}"] in fmstore.toml) to tier it'
        )
    return (
        f"an fmstore checkpoint named {name!r}, not step_NNNNNNNNNNNN: its name holds no "
        "step, so no policy tiers it"
    )


def _dir_reason(name: str, markers: set[str], root: str, declared: StepPattern | None) -> str:
    if DCP_METADATA in markers:
        return DCP
    if MANIFEST_KEY in markers:
        return _named(name, root, declared)
    for pattern, whose, instead in _DIR_NAMES:
        if pattern.match(name):
            return (
                f"named like {whose} checkpoints, holding neither {MANIFEST_KEY} nor "
                f"{DCP_METADATA}: not a checkpoint fmstore reads, never tiered; save it "
                f"through {instead}"
            )
    return f"not a step of run root {root!r}, which declares step_pattern {_text(declared)!r}"


def _text(p: StepPattern | None) -> str:
    return "step_NNNNNNNNNNNN" if p is None else p.text


def _file_reason(name: str) -> str | None:
    for suffix, why in _FILES.items():
        if name.endswith(suffix) and len(name) > len(suffix):
            return why
    return None


async def look(
    store: Store,
    tier: str,
    prefix: str,
    patterns: dict[str, StepPattern],
    notes: NotCounted | None,
) -> Look:
    """One listing of ``prefix`` on ``store`` (``tier``): its step directories (named as
    ``patterns`` say for it as a run root) and other directories, ascending.  With
    ``notes``, what it shows and fmstore does not count is noted there: foreign-named
    directories (one listing each of those listed, to tell what they hold), bare checkpoint
    files, and the prefix itself when it holds no step but is a native DCP checkpoint or an
    fmstore one under a name that is no step of its parent (nothing below it is looked
    at).  NotFound: an empty look."""
    prefix = _keys.validate_prefix(prefix)
    root = prefix.rstrip("/")
    here = f"{tier}:{root}"
    step_of, declared = step_parser(patterns, root), patterns.get(root)
    out = Look()
    markers: set[str] = set()
    candidates: list[str] = []
    files: list[tuple[str, str]] = []
    unlisted = 0
    try:
        async for meta in store.list(prefix, recursive=False):
            name = meta.key[len(prefix) :].rstrip("/")
            if not name:
                continue
            if not meta.is_dir:
                if name in (MANIFEST_KEY, DCP_METADATA):
                    markers.add(name)
                elif notes is not None and (why := _file_reason(name)) is not None:
                    if len(files) + len(candidates) < notes.per_root:
                        files.append((name, why))
                    else:
                        unlisted += 1
                continue
            if (step := step_of(name)) is not None:
                out.steps.append(step)
            elif name.startswith("."):
                continue
            elif parse_step(name) is not None or any(p.match(name) for p, _, _ in _DIR_NAMES):
                # a step_… name under a root that declares another pattern, or a stack's
                if notes is None:
                    out.dirs.append(name)
                elif len(files) + len(candidates) < notes.per_root:
                    candidates.append(name)
                else:
                    unlisted += 1
            else:
                out.dirs.append(name)
    except NotFound:
        return out
    out.steps.sort()
    out.dirs.sort()
    if notes is None:
        return out
    if root and markers and not out.steps:  # itself a checkpoint, not a step of its parent
        parent, _, name = root.rpartition("/")
        notes.add(
            f"{tier}:{parent}", here, _dir_reason(name, markers, parent, patterns.get(parent))
        )
        return Look()
    for name, why in files:
        notes.add(here, f"{here}/{name}", why)
    for name in candidates:
        if not notes.room(here):
            unlisted += 1
            continue
        found, dirs = await _markers(store, f"{prefix}{name}/")
        if not found and dirs:  # a directory of directories (run roots below?): looked into
            out.dirs.append(name)
        else:
            notes.add(here, f"{here}/{name}", _dir_reason(name, found, root, declared))
    if unlisted:
        notes.skip(here, unlisted)
    out.dirs.sort()
    return out
