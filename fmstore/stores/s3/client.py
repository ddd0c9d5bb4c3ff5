"""The S3 backend's shared clients: one aiobotocore client and one lean transport, with
their connection pools, per process, event loop, :class:`~.options.S3Options` and bucket.

The aiobotocore client is created lazily on the running loop (the fmstore runtime loop for
sync callers) and shared, with its lean transport, by every store of the process with the
same :class:`~.options.S3Options` and bucket on that loop: creating one costs 0.1-0.3 s of
CPU (botocore parses its service models), which code that opens a store per checkpoint
(DCP's writers and readers) would otherwise pay on every save and load, with a fresh
connection pool each time.  Where the lean transport needs nothing botocore resolves (an
explicit endpoint and region, static keys in the options or the environment), the client is
only made for the first call the lean transport does not serve, so a command that lists and
reads starts 0.6 s sooner.  The last ``S3Store.close`` of the stores using a client closes
it (a store dropped without ``close`` leaves it open for the next store); whatever is open
at exit is closed then.  A forked child creates its own, and never touches its parent's
(:func:`leave_to_parent`).

Whether a shared client has a lean transport at all is settled here, once, when it is made
(:func:`lean_static`, :func:`lean_for_client`); which of the two transports serves each
call after that is :class:`~.transport.FallbackTransport`'s to say.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import weakref
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

from ... import runtime
from ..base import Store
from .options import S3Options
from .retry import translate
from .transport import BotocoreTransport, LeanUnsupported, Transport

log = logging.getLogger(__name__)

#: A forked child's inherited clients, kept alive and untouched (see ``S3Store._reset``).
_FORK_LEFTOVERS: list[Any] = []
#: botocore's loader of service models and endpoint rules, shared by every session of the
#: process.  Parsing those JSON files is most of what creating a client costs (0.2-0.4 s
#: of CPU); a forked child (a DataLoader worker) inherits the parsed models from its parent
#: and so creates its own client in a few milliseconds.  The loader holds only parsed
#: files: no connection, credential or event-loop state.  Keyed by botocore's ``data_path``
#: setting, the one thing a loader is built from.
_DATA_LOADERS: dict[Any, Any] = {}


class SharedClient:
    """One aiobotocore client, the lean transport and their connection pools, shared by
    the stores of this process with equal options on one loop (see the module docstring).

    ``client`` may be created late, on the first call the lean transport does not serve
    (:meth:`botocore`): a command that only lists, reads and writes small objects never
    pays for botocore's client (about 0.6 s of imports and service-model parsing).
    ``boto`` is the botocore transport over it, ``lean`` the lean one (None where it
    cannot serve).
    """

    def __init__(
        self,
        key: tuple[Any, ...],
        client: Any,
        lean: Transport | None,
        stack: AsyncExitStack,
        make: Callable[[AsyncExitStack], Awaitable[Any]],
        bucket: str,
    ) -> None:
        self.key, self.client, self.lean, self.stack = key, client, lean, stack
        self.boto = BotocoreTransport(self.botocore, bucket)
        self.users: weakref.WeakSet[Store] = weakref.WeakSet()
        self.closed = False
        self._make = make
        self._making: asyncio.Lock | None = None

    async def botocore(self) -> Any:
        """The aiobotocore client, created on first use."""
        if self.client is None:
            self._making = self._making or asyncio.Lock()
            async with self._making:
                if self.client is None:
                    self.client = await self._make(self.stack)
        return self.client

    async def release(self, store: Store) -> None:
        """``store`` is closed: close the client when no open store uses it any more."""
        self.users.discard(store)
        if not self.users:
            await self.close()

    async def close(self) -> None:
        """Close every store still using the client (their writers are aborted), then it."""
        for store in list(self.users):
            try:
                await store.close()
            except Exception as e:  # one store's failed abort must not keep the pool open
                log.warning("closing %r: %s", store, e)
        if self.closed:
            return
        self.closed = True
        if _SHARED.get(self.key) is self:
            del _SHARED[self.key]
        await self.stack.aclose()


#: (pid, loop, options, bucket) -> the shared client; creations in progress in ``_CREATING``.
_SHARED: dict[tuple[Any, ...], SharedClient] = {}
_CREATING: dict[tuple[Any, ...], asyncio.Future[SharedClient]] = {}
#: One botocore session per profile and AWS config files: it caches the parsed service
#: models, and the profile's settings as the files said when it was made.
_SESSIONS: dict[tuple[Any, ...], Any] = {}
_AWS_FILES = (
    ("AWS_CONFIG_FILE", "~/.aws/config"),
    ("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"),
)


def _session_key(o: S3Options) -> tuple[Any, ...]:
    """A session is reused only while the AWS config and credentials files it read are the
    same files, unchanged: a rotated credentials file, or another AWS_CONFIG_FILE, gets a
    session of its own instead of the settings read before."""
    files: list[tuple[str, int, int] | str] = []
    for var, default in _AWS_FILES:
        path = os.path.expanduser(os.environ.get(var) or default)
        try:
            st = os.stat(path)
        except OSError:
            files.append(path)
        else:
            files.append((path, st.st_mtime_ns, st.st_size))
    return (os.getpid(), o.profile, tuple(files))


async def shared_client(
    key: tuple[Any, ...], make: Callable[[], Awaitable[SharedClient]]
) -> SharedClient:
    """The shared client for ``key`` (pid, running loop, options, bucket): the one already
    made, the one being made (awaited), or a new one from ``make``, closed at exit."""
    running = key[1]
    shared = _SHARED.get(key)
    if shared is None:
        pending = _CREATING.get(key)
        if pending is None:
            for k in [k for k in _SHARED if k[1].is_closed()]:
                _FORK_LEFTOVERS.append(_SHARED.pop(k))  # a dead loop's: unusable, left as is
            pending = running.create_future()
            _CREATING[key] = pending
            try:
                shared = await make()
            except BaseException as e:
                pending.set_exception(e)
                pending.exception()  # retrieved: no "never retrieved" warning
                raise
            finally:
                del _CREATING[key]
            _SHARED[key] = shared
            pending.set_result(shared)
            runtime.close_at_exit(shared)  # close the pool at exit, not at garbage collection
        else:
            shared = await asyncio.shield(pending)
    return shared


def leave_to_parent(shared: SharedClient) -> None:
    """Never let a forked child close (or garbage-collect) the parent's client: its
    transports would unregister their sockets from the epoll instance the child shares
    with the parent, and the parent's next response would never arrive."""
    _FORK_LEFTOVERS.append(shared)


async def make_shared(
    key: tuple[Any, ...], o: S3Options, *, bucket: str, tier: str
) -> SharedClient:
    """A new shared client: the lean transport alone where it needs nothing of botocore's
    (:func:`lean_static`), else botocore's client and the lean transport over
    what it resolved; errors as :mod:`fmstore.errors`."""

    async def make_client(stack: AsyncExitStack) -> Any:
        """An aiobotocore client, closed with ``stack``; errors as :mod:`fmstore.errors`."""
        try:
            return await create_client(o, stack)
        except Exception as e:
            raise translate(e, tier=tier, key=None, bucket=bucket, op="connect") from e

    stack = AsyncExitStack()
    try:
        lean = lean_static(o, bucket)
        if lean is not None:
            stack.push_async_callback(lean.close)
            client = None
        else:
            client = await make_client(stack)
            lean = await lean_for_client(o, bucket, client)
            if lean is not None:
                stack.push_async_callback(lean.close)
    except Exception as e:
        await stack.aclose()
        raise translate(e, tier=tier, key=None, bucket=bucket, op="connect") from e
    return SharedClient(key, client, lean, stack, make_client, bucket)


async def create_client(o: S3Options, stack: AsyncExitStack) -> Any:
    """An aiobotocore client for ``o``, closed with ``stack``."""
    from aiobotocore.config import AioConfig
    from aiobotocore.session import AioSession

    skey = _session_key(o)
    session = _SESSIONS.get(skey)
    if session is None:
        session = AioSession(profile=o.profile) if o.profile else AioSession()
        session.register_component("data_loader", _data_loader(session))
        _SESSIONS[skey] = session
    # botocore SHA256-signs every body sent over plain http, on the event loop (about
    # 1 s of CPU per GB).  When a checksum of ours covers the body (CRC32C or MD5,
    # checked by the server) the signature need not cover it too: UNSIGNED-PAYLOAD,
    # as botocore itself does over https.  Only what fmstore was told is set: a
    # profile's ``s3 = addressing_style`` and its endpoint stay botocore's to apply.
    s3: dict[str, Any] = {"payload_signing_enabled": o.checksum == "off"}
    style = addressing_style(o, session.get_config_variable("s3"))
    if style:
        s3["addressing_style"] = style
    config = AioConfig(
        region_name=o.region,
        s3=s3,
        # Our own loop (.retry) retries whole requests including their bodies.
        retries={"total_max_attempts": 1, "mode": "standard"},
        max_pool_connections=o.max_concurrency + 4,
        connect_timeout=o.connect_timeout,
        read_timeout=o.read_timeout,
        # We send CRC32C ourselves (computed off the loop); botocore would compute
        # CRC32 on the event loop for every body.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        # botocore's validation refuses memoryview bodies (only bytes, bytearray or
        # files), so every part of a large put would need a copy (~1 s of CPU per GB
        # here, mostly page faults on fresh memory).  Every request is built by this
        # package from validated keys, so the check only costs time.
        parameter_validation=False,
        connector_args={"socket_factory": functools.partial(tuned_socket, o.socket_buffer)},
    )
    kwargs: dict[str, Any] = {"config": config}
    if o.endpoint_url:
        kwargs["endpoint_url"] = o.endpoint_url
        if o.endpoint_url.startswith("http://"):
            kwargs["verify"] = False  # no TLS: skip loading the CA bundle (~0.1 s)
    if o.access_key or o.secret_key:
        kwargs["aws_access_key_id"] = o.access_key
        kwargs["aws_secret_access_key"] = o.secret_key
        kwargs["aws_session_token"] = o.session_token
    region = o.region or session.get_config_variable("region")
    kwargs["region_name"] = region or "us-east-1"
    client = await stack.enter_async_context(session.create_client("s3", **kwargs))
    _keep_bodies_as_bytes(client)
    return client


def addressing_style(o: S3Options, profile_s3: Any) -> str | None:
    """The addressing style to give botocore: the options' (a tier's or ``[s3]`` of
    fmstore.toml), else the profile's ``s3 = addressing_style`` (None: botocore applies
    it), else ``path`` for an endpoint fmstore was given (SeaweedFS, MinIO), else None
    (botocore's ``auto``)."""
    if o.addressing_style:
        return o.addressing_style
    if isinstance(profile_s3, dict) and profile_s3.get("addressing_style"):
        return None
    return "path" if o.endpoint_url else None


def _profile_s3(o: S3Options) -> dict[str, Any]:
    """The ``s3`` section of the active profile in the AWS config file, read without a
    botocore session (the lean path that needs none); {} where there is none."""
    env = os.environ
    path = os.path.expanduser(env.get("AWS_CONFIG_FILE") or "~/.aws/config")
    if not os.path.isfile(path):
        return {}
    from botocore.configloader import load_config

    name = o.profile or env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    try:
        section = load_config(path).get("profiles", {}).get(name, {}).get("s3")
    except Exception:  # botocore reports a broken file when it reads it
        return {}
    return section if isinstance(section, dict) else {}


def _data_loader(session: Any) -> Any:
    """The process-wide botocore data loader for ``session``'s data path."""
    path = session.get_config_variable("data_path")
    loader = _DATA_LOADERS.get(path)
    if loader is None:
        loader = _DATA_LOADERS[path] = session.get_component("data_loader")
    return loader


def _keep_bodies_as_bytes(client: Any) -> None:
    """Stop botocore wrapping ``bytes`` bodies in ``BytesIO``.

    botocore does that so its own retries can rewind the body; ours resend the whole
    request, so it only costs: aiohttp copies a ``BytesIO`` once more (``getbuffer``) and
    then sends it in 256 KiB pieces with an event-loop round trip each, where ``bytes``
    go to the socket in one write.
    """
    from botocore.handlers import convert_body_to_file_like_object

    for op in ("PutObject", "UploadPart"):
        client.meta.events.unregister(
            f"before-parameter-build.s3.{op}", convert_body_to_file_like_object
        )


# ---- where the lean transport can serve -------------------------------------------------


def tuned_socket(buffer: int, addr_info: Any) -> socket.socket:
    """A connection's socket: keep-alive on (aiobotocore ignores ``tcp_keepalive``) and
    ``buffer`` bytes of kernel send / receive buffer when non-zero."""
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if buffer:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
    except OSError:
        sock.close()
        raise
    return sock


def lean_static(o: S3Options, bucket: str) -> Transport | None:
    """The lean transport without botocore, where nothing needs botocore to resolve
    it: an explicit endpoint, a region and static keys given in the options or in the
    environment (botocore's first source of credentials; a profile would skip it).
    None otherwise, and the client's resolution is used."""
    env = os.environ
    region = o.region or env.get("AWS_DEFAULT_REGION")
    if not o.lean_requests or not o.endpoint_url or not region:
        return None
    if o.access_key and o.secret_key:
        creds = (o.access_key, o.secret_key, o.session_token)
    elif (
        not o.profile
        and "AWS_CREDENTIAL_EXPIRATION" not in env  # refreshing: botocore's job
        and env.get("AWS_ACCESS_KEY_ID")
        and env.get("AWS_SECRET_ACCESS_KEY")
    ):
        token = env.get("AWS_SECURITY_TOKEN") or env.get("AWS_SESSION_TOKEN")
        creds = (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], token)
    else:
        return None
    from .lean import Credentials

    frozen = Credentials(*creds)
    style = o.addressing_style
    if not style:
        profile = _profile_s3(o).get("addressing_style")
        style = profile if profile in ("path", "virtual", "auto") else "path"
    if style == "auto":
        return None  # botocore's rules decide per bucket and endpoint
    return _lean(o, bucket, o.endpoint_url, region, lambda: frozen, path_style=style == "path")


async def lean_for_client(o: S3Options, bucket: str, client: Any) -> Transport | None:
    """The lean transport for exactly the URL, addressing style, signing region and
    credentials botocore ``client`` resolved for ``bucket`` (its endpoint rules applied to
    the options, ``AWS_ENDPOINT_URL*`` and the profile), or None where it cannot serve
    them."""
    creds = getattr(getattr(client, "_request_signer", None), "_credentials", None)
    if not o.lean_requests or creds is None:
        return None
    resolved = await resolve_bucket_url(client, bucket)
    if resolved is None:
        return None
    endpoint, path_style, region = resolved
    return _lean(o, bucket, endpoint, region, creds.get_frozen_credentials, path_style=path_style)


async def resolve_bucket_url(client: Any, bucket: str) -> tuple[str, bool, str] | None:
    """``(endpoint, path_style, signing_region)`` of ``bucket``'s requests, as botocore's
    endpoint rules resolve them for ``client``; None where they need more than SigV4 on a
    plain endpoint (S3 Express, SigV4a) or the rules cannot be asked."""
    from urllib.parse import quote, urlsplit, urlunsplit

    try:
        op = client.meta.service_model.operation_model("ListObjectsV2")
        url, _, props = await client._resolve_endpoint_ruleset(op, {"Bucket": bucket}, {})
    except Exception as e:  # a private botocore call: never fatal, botocore serves all
        log.debug("could not resolve the endpoint of bucket %s: %s", bucket, e)
        return None
    schemes = (props or {}).get("authSchemes") or [{}]
    scheme = schemes[0]
    if scheme.get("name", "sigv4") != "sigv4" or props.get("backend") == "S3Express":
        return None
    region = scheme.get("signingRegion") or client.meta.region_name
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    quoted = "/" + quote(bucket, safe="")
    if path.endswith(quoted) or path.endswith("/" + bucket):
        base = path[: path.rindex("/")]
        return urlunsplit((parts.scheme, parts.netloc, base, "", "")), True, region
    if (parts.hostname or "").startswith(bucket + "."):
        netloc = parts.netloc[len(bucket) + 1 :]
        return urlunsplit((parts.scheme, netloc, path, "", "")), False, region
    return None


def _lean(
    o: S3Options,
    bucket: str,
    endpoint: str,
    region: str,
    credentials: Callable[[], Any],
    *,
    path_style: bool,
) -> Transport | None:
    from .lean import LeanTransport

    try:
        return LeanTransport(
            endpoint_url=endpoint,
            region=region,
            bucket=bucket,
            path_style=path_style,
            credentials=credentials,
            sign_payload=o.checksum == "off",
            pool=o.max_concurrency + 4,
            connect_timeout=o.connect_timeout,
            read_timeout=o.read_timeout,
            socket_factory=functools.partial(tuned_socket, o.socket_buffer),
        )
    except LeanUnsupported:
        return None
