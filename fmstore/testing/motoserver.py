"""A second, independent S3 server for tests: moto's standalone ``moto_server`` on loopback.

SeaweedFS is the project's S3 server; what it does not implement (part checksums in
GetObjectAttributes, ``FULL_OBJECT`` versus composite multipart checksums, conditional
writes answered as AWS answers them) would stay untested, or tested only through fmstore's
fallbacks, without a second implementation.  :class:`MotoServer` runs the ``moto`` package's
standalone HTTP server (``moto_server``, a real server speaking the S3 API over HTTP, not
the in-process mock decorators) in its own process on a free loopback port, with state in
that process's memory.  It has the conveniences of :class:`~.seaweed.SeaweedServer`
(``store_options``, ``boto3_client``, ``create_bucket``, ``env`` ...), so a test takes
either.

moto accepts any credentials and checks no signatures unless told to; the read-only
identity is therefore not a refused one here (tests that need a refusal say so in their
table of server differences).  The process runs in its own session and is stopped by its
pid: SIGTERM, then SIGKILL after a short grace period.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from .seaweed import START_TIMEOUT, SeaweedServer, _die_with_parent, free_ports


class MotoError(RuntimeError):
    """``moto_server`` could not be started (the message ends with the tail of its log)."""


def find_moto_server() -> str:
    """Path of ``moto_server``: next to the running interpreter (``pip install
    'moto[server]'`` puts it in the environment's ``bin``), else on ``PATH``."""
    here = os.path.join(os.path.dirname(sys.executable), "moto_server")
    if os.access(here, os.X_OK):
        return here
    found = shutil.which("moto_server")
    if found:
        return found
    raise MotoError("'moto_server' was not found: pip install 'moto[server]'")


class MotoServer(SeaweedServer):
    """One ``moto_server`` process on ``endpoint_url`` (S3 only is used)."""

    name = "moto"

    def __init__(self, *, binary: str | None = None, base_dir: str | None = None) -> None:
        # The binary goes where SeaweedServer keeps weed's (it needs no weed of its own).
        super().__init__(weed=binary or find_moto_server(), base_dir=base_dir)
        self.access_key = "fmstore-admin"
        self.readonly_access_key = "fmstore-reader"

    @property
    def log_path(self) -> str:
        assert self.dir is not None
        return os.path.join(self.dir, "moto.log")

    def start(self) -> MotoServer:
        if self.proc is not None:
            return self
        self.dir = tempfile.mkdtemp(prefix="fmstore-moto-", dir=self._base_dir)
        (self.s3_port,) = free_ports(1)
        # No AWS_* of the caller's: moto would take a region or an endpoint from them.
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env["MOTO_ALLOW_NONEXISTENT_REGION"] = "false"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the server
        self._stopped = False
        self.proc = subprocess.Popen(
            [self.weed, "-H", "127.0.0.1", "-p", str(self.s3_port)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self.dir,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        atexit.register(self.stop)
        try:
            self._wait_up()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_up(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        assert self.proc is not None
        while True:
            if self.proc.poll() is not None:
                raise MotoError(
                    f"moto_server exited with status {self.proc.returncode} during start:\n"
                    + self.log_tail()
                )
            try:
                with urllib.request.urlopen(self.endpoint_url + "/moto-api/", timeout=1) as r:
                    r.read()
                return
            except urllib.error.HTTPError:
                return  # it answers HTTP: up
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise MotoError(
                    f"moto_server did not answer on {self.endpoint_url} within "
                    f"{START_TIMEOUT:.0f} s:\n" + self.log_tail()
                )
            time.sleep(0.05)

    def __enter__(self) -> MotoServer:
        return self.start()
