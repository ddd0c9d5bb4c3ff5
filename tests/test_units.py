"""One units module: a size or a duration means the same in every flag and config key."""

from __future__ import annotations

import pytest
import typer

from fmstore.cli.util import size_option
from fmstore.config import from_dict
from fmstore.errors import ConfigError
from fmstore.tiering.service.daemon import settings_from_config
from fmstore.units import parse_duration, parse_size


@pytest.mark.parametrize("text", ["500M", "500MB", "500MiB", "500 mib", "0.48828125G", "500MB/s"])
def test_every_spelling_of_500_mebibytes_is_the_same_size(text):
    assert parse_size(text, "x") == 500 << 20


def test_the_cli_and_the_daemon_read_a_rate_alike():
    cfg = from_dict({"daemon": {"bwlimit": "500MB"}})
    assert (
        settings_from_config(cfg).transfer.bwlimit == size_option("500MB", "--bwlimit") == 500 << 20
    )
    cfg = from_dict({"daemon": {"bwlimit": "500M"}})  # refused before there was one parser
    assert settings_from_config(cfg).transfer.bwlimit == 500 << 20


@pytest.mark.parametrize("bad", ["", "fast", "-5M", "0", "1e400", "nan", "5X", True, None, [1]])
def test_a_bad_size_names_where_it_came_from(bad):
    with pytest.raises(ConfigError, match="daemon bwlimit"):
        parse_size(bad, "daemon bwlimit")


def test_a_bad_size_on_the_command_line_is_a_usage_error_naming_the_option():
    with pytest.raises(typer.BadParameter) as e:
        size_option("fast", "--bwlimit")
    assert e.value.param_hint == "--bwlimit" and "fast" in str(e.value)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [(90, 90.0), ("90s", 90.0), ("30m", 1800.0), ("2h", 7200.0), ("250ms", 0.25)],
)
def test_durations(text, seconds):
    assert parse_duration(text, "x") == seconds


@pytest.mark.parametrize("bad", ["0", "-1h", "soon", "5y", False])
def test_a_bad_duration_is_refused(bad):
    with pytest.raises(ConfigError):
        parse_duration(bad, "x")
