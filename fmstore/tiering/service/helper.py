"""The policy helper: a child process that runs a training process's policies at
background priority, so exports never take the trainer's GIL or its cores.

:class:`PolicyHelper` (the parent side, used by ``CheckpointManager``) starts
``python -m fmstore.tiering.service.helper`` and talks to it over its stdin and stdout, one line
per message:

* parent → helper: the settings as one JSON line, then ``poke`` after every committed save
  and ``stop`` to finish (end of file means the same: a trainer that dies takes its helper
  with it, after the copy in flight, which is resumable anyway);
* helper → parent: ``idle N`` after a step that found nothing to do, ``N`` being the pokes
  it had read before that step began, which is what :meth:`PolicyHelper.wait_idle` waits
  for; ``warn TEXT`` (TEXT a JSON string) for what the training process must hear: a tier
  the start-up check (:mod:`.probe`, once per node) found unusable, an export that has
  failed ``[policies] warn_after_failures`` times.  The parent logs it at warning.

The helper lowers its priority (:func:`~fmstore.tiering.service.priority.lower_priority`, from
``[daemon] priority``) before it starts a thread, and then runs the same
:class:`~fmstore.tiering.service.background.BackgroundRunner` as the in-thread mode.  The settings
travel as JSON of plain dataclasses, decoded only into the types named in :data:`_TYPES`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO, Any

from ...config import Config, TierConfig
from ..copy.transfer import TransferOptions
from ..inventory.catalog import Catalog
from ..policy.rules import ExportRule, Policies, ReleaseRule, RestoreRule, RetentionRule
from ..policy.runner import PolicyRunner
from ..probe import probe_once_per_node
from .background import BackgroundRunner, IdleSignal
from .priority import lower_priority

log = logging.getLogger("fmstore.tiering")

_TYPES: dict[str, type] = {
    t.__name__: t
    for t in (
        Config,
        TierConfig,
        Policies,
        ExportRule,
        RetentionRule,
        ReleaseRule,
        RestoreRule,
        TransferOptions,
    )
}
#: The longest settings line the helper reads (a config is a few KiB).
MAX_SETTINGS = 4 << 20


def encode(obj: Any) -> Any:
    """Plain JSON for the dataclasses of :data:`_TYPES`, tuples, mappings and scalars."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        name = type(obj).__name__
        if _TYPES.get(name) is not type(obj):
            raise TypeError(f"{name} cannot be sent to the policy helper")
        fields = {f.name: encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {"@": name, **fields}
    if isinstance(obj, tuple):
        return {"@": "tuple", "items": [encode(x) for x in obj]}
    if isinstance(obj, list):
        return [encode(x) for x in obj]
    if isinstance(obj, dict) or hasattr(obj, "items"):
        return {"@": "dict", "items": [[k, encode(v)] for k, v in obj.items()]}
    if obj is None or isinstance(obj, str | int | float | bool):
        return obj
    raise TypeError(f"{type(obj).__name__} cannot be sent to the policy helper")


def decode(obj: Any) -> Any:
    if isinstance(obj, list):
        return [decode(x) for x in obj]
    if not isinstance(obj, dict):
        return obj
    tag = obj.get("@")
    if tag == "tuple":
        return tuple(decode(x) for x in obj["items"])
    if tag == "dict":
        return {k: decode(v) for k, v in obj["items"]}
    cls = _TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ValueError(f"unknown type {tag!r} in the policy helper's settings")
    return cls(**{k: decode(v) for k, v in obj.items() if k != "@"})


class PolicyHelper:
    """The parent's handle on a helper process; the same calls as
    :class:`~fmstore.tiering.service.background.BackgroundRunner` (``poke``, ``wait_idle``, ``close``)."""

    def __init__(
        self,
        config: Config,
        policies: Policies,
        transfer: TransferOptions,
        *,
        interval: float,
        priority: str,
    ) -> None:
        settings = {
            "config": config,
            "policies": policies,
            "transfer": transfer,
            "interval": interval,
            "priority": priority,
            "log_level": logging.getLogger("fmstore").getEffectiveLevel(),
        }
        line = json.dumps(encode(settings)) + "\n"
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "fmstore.tiering.service.helper"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._stdin = self._proc.stdin
        #: What the helper warned about, newest last (also logged at warning here).
        self.warnings: list[str] = []
        self._write_lock = threading.Lock()
        self._signal = IdleSignal()
        self._send(line)
        self._reader = threading.Thread(
            target=self._read, args=(self._proc.stdout,), name="fmstore-helper-reader", daemon=True
        )
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _send(self, line: str) -> bool:
        with self._write_lock:
            return self._send_locked(line)

    def _send_locked(self, line: str) -> bool:
        try:
            self._stdin.write(line.encode())
            self._stdin.flush()
            return True
        except (BrokenPipeError, ValueError, OSError):
            return False

    def _read(self, out: IO[bytes]) -> None:
        for raw in out:
            parts = raw.split()
            if len(parts) == 2 and parts[0] == b"idle" and parts[1].isdigit():
                self._signal.idle(int(parts[1]))
            elif raw.startswith(b"warn "):
                with contextlib.suppress(ValueError):
                    text = json.loads(raw[5:])
                    if isinstance(text, str):
                        self.warnings = [*self.warnings[-9:], text]
                        log.warning("%s", text)
        self._signal.end()

    def poke(self) -> int:
        # Counted under the write lock: the helper numbers pokes in the order they arrive.
        with self._write_lock:
            n = self._signal.poke()
            sent = self._send_locked("poke\n")
        if not sent:
            self._signal.end()
        return n

    def wait_idle(
        self, timeout: float | None = None, give_up: Callable[[], bool] | None = None
    ) -> bool:
        """Wait until a step of the helper that began after this call finds nothing to do;
        False on timeout, when the helper is gone or as soon as ``give_up()`` is true."""
        return self._signal.wait(self.poke(), timeout, give_up)

    def close(self, timeout: float | None = 60.0) -> None:
        """Stop after the copy in flight; kill the helper if it has not exited by then."""
        self._send("stop\n")
        with contextlib.suppress(OSError):
            self._stdin.close()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning(
                "the policy helper (pid %d) did not stop in %ss; killing it",
                self._proc.pid,
                timeout,
            )
            self._proc.kill()
            self._proc.wait()
        self._reader.join(5)


def tier_problems(runner: PolicyRunner) -> list[str]:
    """The tier check of :mod:`.probe` (once per node: a fresh result of another process is
    reused), as warnings for the training process."""
    rep = probe_once_per_node(runner.config, runner.policies, runner.tiers)
    return [f"fmstore tier check: {p.describe()}" for p in rep.problems]


def main() -> int:
    # Ctrl-C reaches the whole foreground group; the trainer decides when this one stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raw = sys.stdin.buffer.readline(MAX_SETTINGS)
    if not raw.endswith(b"\n"):
        print("fmstore policy helper: no settings on stdin", file=sys.stderr)
        return 2
    s = decode(json.loads(raw))
    # Before any thread exists: every thread started from here on inherits it.
    lower_priority(s["priority"])
    logging.basicConfig(
        level=s["log_level"], format=f"fmstore policy helper [{os.getpid()}]: %(message)s"
    )
    out = sys.stdout.buffer
    out_lock = threading.Lock()

    def send(line: bytes) -> None:
        with out_lock, contextlib.suppress(OSError, ValueError):
            out.write(line)
            out.flush()

    def on_idle(n: int) -> None:
        send(b"idle %d\n" % n)

    def on_warn(text: str) -> None:
        send(b"warn " + json.dumps(text).encode() + b"\n")

    catalog = Catalog.for_state_dir(s["config"].state_dir)
    runner = PolicyRunner(s["config"], s["policies"], catalog, mover=s["transfer"])
    bg = BackgroundRunner(
        runner,
        interval=s["interval"],
        on_idle=on_idle,
        on_warn=on_warn,
        startup_check=lambda: tier_problems(runner),
    )
    try:
        for line in sys.stdin.buffer:
            if line.strip() == b"poke":
                bg.poke()
            elif line.strip() == b"stop":
                break
    finally:
        bg.close(timeout=None)
        from ... import runtime

        with contextlib.suppress(Exception):
            runtime.run(runner.tiers.close(), timeout=30)
        catalog.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
