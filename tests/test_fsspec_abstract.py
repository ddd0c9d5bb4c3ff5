"""fsspec's own abstract test suites (``fsspec.tests.abstract``: copy, get, put, open, pipe)
against ``fmstore://``, wired as s3fs and gcsfs wire them: one fixtures class
(``AbstractFixtures``) per backend, each suite class deriving from it.

They run on a POSIX tier and on SeaweedFS in ``make test``, where each suite's 32
glob edge cases (which check fsspec's glob expansion over ``ls``/``find``, the same on every
tier) are sampled (:data:`GLOB_SAMPLE`); ``make test-compat`` (``FMSTORE_COMPAT=1``) runs
every case, and on moto's server too.  A suite the installed fsspec does not ship is
skipped.  The cases fmstore answers otherwise, and
why, are :data:`EXCEPTIONS` (and docs/stores.md); every other case must pass.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from stage_data import write_s3_config

from fmstore.fsspec import FmstoreFileSystem

abstract = pytest.importorskip("fsspec.tests.abstract")

SUITES = ("Copy", "Get", "Put", "Open", "Pipe")

#: (suite test name) -> why fmstore answers otherwise.  Directories are key prefixes on
#: every tier (``supports_empty_directories`` is False, as for s3fs), which the suites
#: allow for; what is left is listed here.
EXCEPTIONS: dict[str, str] = {}

#: (path, recursive, maxdepth) of the glob edge cases ``make test`` runs.
GLOB_SAMPLE = {
    ("*", True, 2),
    ("**", True, None),
    ("**/*1", False, 2),
    ("subdir[0-1]/*fil[e]*", True, None),
}
COMPAT = os.environ.get("FMSTORE_COMPAT") == "1"


def _sampled(case: Callable[..., Any]) -> Callable[..., Any]:
    """``case`` (a parametrized glob edge case) run only for :data:`GLOB_SAMPLE` outside
    ``make test-compat``; ``functools.wraps`` keeps its parametrization."""

    @functools.wraps(case)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        key = (kwargs.get("path"), kwargs.get("recursive"), kwargs.get("maxdepth"))
        if not COMPAT and key not in GLOB_SAMPLE:
            pytest.skip("glob edge case outside the sample: make test-compat runs it")
        return case(self, *args, **kwargs)

    return run


class _FmstoreFixtures(abstract.AbstractFixtures):
    """``fs`` on one tier of a config written for the test; ``fs_path`` a fresh directory
    there per test (nothing is shared between cases)."""

    tier = ""

    @pytest.fixture(scope="class")
    def fs(self, request: Any, tmp_path_factory: Any) -> FmstoreFileSystem:
        base = tmp_path_factory.mktemp("abstract")
        cfg = base / "fmstore.toml"
        if self.tier == "nvme":
            cfg.write_text(
                f'state_dir = "{base / "state"}"\n[tiers.nvme]\nurl = "{base / "nvme"}"\n'
            )
        else:
            server = request.getfixturevalue(f"{self.tier}_server")
            bucket = server.create_bucket(f"abs-{uuid.uuid4().hex[:16]}")
            request.addfinalizer(lambda: server.delete_bucket(bucket))
            write_s3_config(cfg, server.endpoint_url, bucket)
            mp = pytest.MonkeyPatch()
            mp.setenv("AWS_ACCESS_KEY_ID", server.access_key)
            mp.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
            request.addfinalizer(mp.undo)
        return FmstoreFileSystem(config=str(cfg), skip_instance_cache=True)

    @pytest.fixture(autouse=True)
    def _cwd_left_empty(self, tmp_path_factory: Any, monkeypatch: Any) -> Any:
        """Each case runs in an empty working directory that it must leave empty: a local
        path that lost its leading "/" would land there (files of a get once landed in
        the repository, which was the working directory)."""
        cwd = tmp_path_factory.mktemp("cwd")
        monkeypatch.chdir(cwd)
        yield
        left = sorted(str(p.relative_to(cwd)) for p in cwd.rglob("*"))
        assert not left, f"the case wrote under the working directory: {left[:10]}"

    @pytest.fixture
    def fs_join(self) -> Any:
        return lambda *args: "/".join(args)

    @pytest.fixture
    def fs_path(self) -> str:
        return f"{'nvme' if self.tier == 'nvme' else 's3'}/abstract-{uuid.uuid4().hex[:12]}"

    @pytest.fixture
    def supports_empty_directories(self) -> bool:
        return False


def _tier_fixtures(tier: str) -> type:
    return type(f"Fixtures_{tier}", (_FmstoreFixtures,), {"tier": tier})


def _suite_classes(tier: str, marks: list[Any]) -> dict[str, type]:
    out: dict[str, type] = {}
    fixtures = _tier_fixtures(tier)
    for name in SUITES:
        suite = getattr(abstract, f"Abstract{name}Tests", None)
        cls_name = f"Test{name}_{tier}"
        if suite is None:
            out[cls_name] = type(
                cls_name,
                (),
                {
                    "test_suite_is_shipped": lambda self, n=name: pytest.skip(
                        f"fsspec has no {n} suite"
                    )
                },
            )
            continue
        cls = type(cls_name, (suite, fixtures), {"pytestmark": marks})
        for case, why in EXCEPTIONS.items():
            if hasattr(cls, case):
                setattr(cls, case, pytest.mark.skip(reason=why)(getattr(cls, case)))
        for case in [c for c in dir(cls) if c.endswith("_glob_edge_cases")]:
            setattr(cls, case, _sampled(getattr(cls, case)))
        out[cls_name] = cls
    return out


globals().update(_suite_classes("nvme", []))
globals().update(_suite_classes("seaweed", [pytest.mark.s3]))
if COMPAT:  # moto's in-memory server: make test-compat only
    globals().update(_suite_classes("moto", [pytest.mark.s3]))
