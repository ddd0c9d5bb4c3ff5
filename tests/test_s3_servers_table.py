"""The table of where the two S3 servers differ from AWS (``tests/s3_servers.py``) stays
true to the tests: every row is consulted by some test, and every suite kept to one server
exists, so a row cannot outlive the case it excuses."""

from __future__ import annotations

from pathlib import Path

from s3_servers import DIFFERENCES, ONE_SERVER, S3_SERVERS

HERE = Path(__file__).parent


def _sources() -> str:
    return "\n".join(
        p.read_text() for p in sorted(HERE.glob("test_*.py")) if p.name != Path(__file__).name
    )


def test_every_row_names_a_server_and_is_consulted_by_a_test():
    text = _sources()
    for server, case in DIFFERENCES:
        assert server in S3_SERVERS, (server, case)
        assert f'"{case}"' in text, f"no test consults the row {server}/{case}"


def test_every_suite_kept_to_one_server_exists():
    text = _sources()
    for name in ONE_SERVER:
        assert f"class {name}(" in text and f'seaweed_only("{name}")' in text, name
