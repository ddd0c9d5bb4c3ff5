from __future__ import annotations

import os

import pytest

from fmstore.config import from_dict, load_config
from fmstore.errors import ConfigError
from fmstore.stores import open_store


def write(tmp_path, text: str):
    p = tmp_path / "fmstore.toml"
    p.write_text(text)
    return p


def test_tiers_and_tier_urls(tmp_path):
    cfg = load_config(
        write(
            tmp_path,
            f"""
state_dir = "{tmp_path}/state"
[tiers.nvme]
url = "{tmp_path}/nvme"
[tiers.lustre]
url = "{tmp_path}/lustre"
stripe_count = 4
""",
        ),
        env={},
    )
    assert cfg.tier("lustre").options == {"stripe_count": 4}
    store = open_store("nvme:ckpts/run1", config=cfg)
    from fmstore import runtime

    runtime.run(store.put("a", b"x"))
    assert (tmp_path / "nvme/ckpts/run1/a").read_bytes() == b"x"


@pytest.mark.parametrize(
    "text,message",
    [
        ('[tiers.nvme]\nulr = "/x"\n', "unknown key 'ulr' (did you mean 'url'?)"),
        ("[tiers.nvme]\n", "needs 'url'"),
        ('[teirs.nvme]\nurl = "/x"\n', "unknown section or key 'teirs' (did you mean 'tiers'?)"),
        ("tiers = 3\n", "[tiers] must be a table"),
        ('[tiers."bad name"]\nurl = "/x"\n', "must be letters"),
        ("[tiers.nvme\nurl=", "not valid TOML"),
    ],
)
def test_bad_config_names_key_and_reason(tmp_path, text, message):
    with pytest.raises(ConfigError) as ei:
        load_config(write(tmp_path, text), env={})
    assert message in str(ei.value)


def test_environment_overrides(tmp_path):
    p = write(tmp_path, f'[tiers.nvme]\nurl = "{tmp_path}/a"\n')
    cfg = load_config(
        p,
        env={
            "FMSTORE__TIERS__NVME__URL": f"{tmp_path}/b",
            "FMSTORE__TIERS__S3__URL": "s3://bucket/pfx",
            "FMSTORE__TIERS__S3__MAX_CONCURRENCY": "16",
        },
    )
    assert cfg.tier("nvme").url == f"{tmp_path}/b"
    assert cfg.tier("s3").options["max_concurrency"] == 16


def test_unknown_tier_and_scheme_are_clear(tmp_path):
    cfg = from_dict({"tiers": {"nvme": {"url": str(tmp_path)}}})
    with pytest.raises(ConfigError, match="unknown tier 'nvmee' \\(did you mean 'nvme'\\?\\)"):
        open_store("nvmee:x", config=cfg)
    with pytest.raises(ConfigError, match="unknown URL scheme 'bogus'"):
        open_store("bogus://x/y", config=cfg)
    with pytest.raises(ConfigError, match="unknown option"):
        open_store(str(tmp_path), config=cfg, part_size=5)


def test_missing_config_file_is_clear(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


# ---- every value type-checked at load time -------------------------------------------------

TYPED = """\
state_dir = "{tmp}/state"

[tiers.nvme]
url = "{tmp}/nvme"
direct_io = false

[tiers.s3]
url = "s3://bucket/p"
region = "us-east-1"
max_concurrency = 32
"""


@pytest.mark.parametrize(
    "old,new,message",
    [
        (
            "max_concurrency = 32",
            'max_concurrency = "32"',
            'line 10: [tiers.s3] max_concurrency must be a whole number >= 1, not "32" (a string)',
        ),
        (
            'region = "us-east-1"',
            "region = 1",
            "line 9: [tiers.s3] region must be a string, not 1 (an integer)",
        ),
        (
            "direct_io = false",
            'direct_io = "false"',
            "line 5: [tiers.nvme] direct_io must be true or false (a TOML boolean, unquoted), "
            'not "false" (a string)',
        ),
        ("direct_io = false", "ulr = 1", "line 5: [tiers.nvme] unknown key 'ulr'"),
    ],
)
def test_a_value_of_the_wrong_type_names_file_line_table_key_and_type(tmp_path, old, new, message):
    p = write(tmp_path, TYPED.format(tmp=tmp_path).replace(old, new))
    with pytest.raises(ConfigError) as ei:
        load_config(p, env={})
    assert str(ei.value) == f"{p}, {message}" or str(ei.value).startswith(f"{p}, {message}")


def test_an_environment_variable_is_named_when_it_set_the_bad_value(tmp_path):
    p = write(tmp_path, TYPED.format(tmp=tmp_path))
    with pytest.raises(ConfigError) as ei:
        load_config(p, env={"FMSTORE__TIERS__S3__MAX_CONCURRENCY": "lots"})
    assert str(ei.value) == (
        f"{p}, set by $FMSTORE__TIERS__S3__MAX_CONCURRENCY: [tiers.s3] max_concurrency "
        'must be a whole number >= 1, not "lots" (a string)'
    )
    # a variable's text is the string a string key asks for, even where TOML reads a number
    cfg = load_config(p, env={"FMSTORE__TIERS__S3__REGION": "1", "FMSTORE__DAEMON__PORT": "9"})
    assert cfg.tier("s3").options["region"] == "1" and cfg.section("daemon")["port"] == 9


def test_sizes_and_durations_are_read_with_their_units(tmp_path):
    p = write(
        tmp_path,
        TYPED.format(tmp=tmp_path)
        + 'part_size = "16MiB"\nconnect_timeout = "2s"\n[s3]\nread_timeout = "1m"\n',
    )
    opts = load_config(p, env={}).tier("s3").options
    assert opts["part_size"] == 16 << 20 and opts["connect_timeout"] == 2.0
    assert opts["read_timeout"] == 60.0


@pytest.mark.parametrize(
    "data,message",
    [
        ({"state_dir": 3}, "config: state_dir must be a string, not 3"),
        ({"s3": {"region": True}}, "[s3] region must be a string, not true (a boolean)"),
        ({"s3": {"part_size": "big"}}, "[s3] part_size must be a size"),
        ({"daemon": {"port": "9464"}}, "[daemon] port must be a whole number 0..65535"),
        ({"daemon": {"interval": "soon"}}, "[daemon] interval must be a duration"),
        ({"stage": {"preserve_owner": "yes"}}, "[stage] preserve_owner must be true or false"),
        ({"checkpoint": {"codec": "zstd"}}, "[checkpoint] unknown key 'codec'"),
        ({"policies": {"ladder": "nvme"}}, "[policies] ladder must be a list of strings"),
        (
            {"policies": {"export": [{"to": "s3"}, {"to": "s3", "every_saves": "2"}]}},
            "[[policies.export]] #2 every_saves must be a whole number >= 1",
        ),
        (
            {"policies": {"retention": {"nvme": {"keep_latest": 1.5}}}},
            "[policies.retention.nvme] keep_latest must be a whole number >= 0",
        ),
        (
            {"policies": {"release": {"nvme": {"high_watermark": "90%"}}}},
            "[policies.release.nvme] high_watermark must be a fraction",
        ),
        ({"policies": {"restore": {"mode": "lasy"}}}, "[policies.restore] mode must be 'lazy'"),
        ({"policies": {"retention": []}}, "[policies.retention] must be a table of tables"),
    ],
)
def test_every_section_is_checked_at_load_time(data, message):
    with pytest.raises(ConfigError) as ei:
        from_dict(data)
    assert message in str(ei.value)


def test_the_schema_and_the_layers_that_read_it_agree():
    """A key added to a layer's reader and not to :data:`SCHEMA` (or the reverse) would be
    refused at load time, or accepted and ignored."""
    from dataclasses import fields

    from fmstore.config import SCHEMA, TierConfig
    from fmstore.stores.posix import PosixOptions
    from fmstore.stores.s3 import S3Options
    from fmstore.tiering.policy import rules
    from fmstore.tiering.service import daemon
    from fmstore.tiering.staging import stage

    assert set(SCHEMA["daemon"]) == daemon._KEYS
    assert set(SCHEMA["stage"]) == set(stage._STAGE_KEYS)
    nested = {"export", "retention", "release", "restore"}
    assert set(SCHEMA["policies"]) | nested == rules._TOP_KEYS
    assert set(SCHEMA["policies.export[]"]) == rules._EXPORT_KEYS
    assert set(SCHEMA["policies.retention.*"]) == rules._RETENTION_KEYS
    assert set(SCHEMA["policies.release.*"]) == rules._RELEASE_KEYS
    assert set(SCHEMA["policies.restore"]) == rules._RESTORE_KEYS
    backend = {f.name for f in fields(S3Options)} | {f.name for f in fields(PosixOptions)}
    assert set(SCHEMA["s3"]) <= backend
    own = {f.name for f in fields(TierConfig)}  # url, scope: read by the config itself
    assert set(SCHEMA["tiers.*"]) - own <= backend


def test_the_cli_prints_one_error_line_for_a_bad_value(tmp_path):
    import subprocess
    import sys

    p = write(tmp_path, TYPED.format(tmp=tmp_path).replace("= 32", '= "32"'))
    r = subprocess.run(
        [sys.executable, "-m", "fmstore", "ls", "nvme:"],
        capture_output=True,
        text=True,
        env={**os.environ, "FMSTORE_CONFIG": str(p)},
        timeout=120,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        f'error: {p}, line 10: [tiers.s3] max_concurrency must be a whole number >= 1, not "32" '
        "(a string)"
    ]


def test_every_config_the_docs_show_passes_the_schema():
    """The examples in docs/, the README and the Kubernetes ConfigMap use only keys and
    types that load: a key added to a guide and not to :data:`SCHEMA` fails here."""
    import re
    from pathlib import Path

    import tomllib
    import yaml

    root = Path(__file__).resolve().parent.parent
    examples = []
    for md in [*sorted((root / "docs").glob("*.md")), root / "README.md"]:
        examples += [(md.name, b) for b in re.findall(r"```toml\n(.*?)```", md.read_text(), re.S)]
    for doc in yaml.safe_load_all((root / "deploy/kubernetes/daemonset.yaml").read_text()):
        if doc and doc.get("kind") == "ConfigMap" and "fmstore.toml" in doc.get("data", {}):
            examples.append(("daemonset.yaml", doc["data"]["fmstore.toml"]))
    assert len(examples) >= 6
    for name, text in examples:
        from_dict(tomllib.loads(text), source=name)


def test_replicas_only_on_a_node_local_tier(tmp_path):
    node = {"url": str(tmp_path), "scope": "node", "replicas": 1}
    assert from_dict({"tiers": {"nvme": node}}).tier("nvme").replicas == 1
    assert from_dict({"tiers": {"nvme": {"url": str(tmp_path)}}}).tier("nvme").replicas == 0
    with pytest.raises(ConfigError, match='replicas needs scope = "node"'):
        from_dict({"tiers": {"lustre": {"url": str(tmp_path), "replicas": 1}}})
    assert from_dict({"tiers": {"nvme": {**node, "replicas": 8}}}).tier("nvme").replicas == 8
    for bad in (9, -1, True, "2"):
        with pytest.raises(ConfigError, match="replicas"):
            from_dict({"tiers": {"nvme": {**node, "replicas": bad}}})


def test_failure_domain_is_a_bounded_name_of_a_node_local_tier(tmp_path, monkeypatch):
    from fmstore.config import failure_domain

    node = {"url": str(tmp_path), "scope": "node", "replicas": 2}
    t = from_dict({"tiers": {"nvme": {**node, "failure_domain": "rack-a"}}}).tier("nvme")
    assert t.failure_domain == "rack-a" and "failure_domain" not in t.options
    monkeypatch.delenv("FMSTORE_FAILURE_DOMAIN", raising=False)
    assert failure_domain(t) == "rack-a"
    monkeypatch.setenv("FMSTORE_FAILURE_DOMAIN", "az1/rack-7")
    assert failure_domain(t) == "az1/rack-7"  # the node's environment wins
    monkeypatch.setenv("FMSTORE_FAILURE_DOMAIN", "../up")
    with pytest.raises(ConfigError, match="FMSTORE_FAILURE_DOMAIN"):
        failure_domain(t)
    for bad in ("", "a b", "x" * 129, 3):
        with pytest.raises(ConfigError, match="failure_domain"):
            from_dict({"tiers": {"nvme": {**node, "failure_domain": bad}}})
    with pytest.raises(ConfigError, match='failure_domain needs scope = "node"'):
        from_dict({"tiers": {"lustre": {"url": str(tmp_path), "failure_domain": "r"}}})


def test_every_config_error_is_reported_at_once(tmp_path):
    import pytest

    from fmstore.config import load_config
    from fmstore.errors import ConfigError

    cfg = tmp_path / "fmstore.toml"
    cfg.write_text(
        '[tiers.nvme]\nurl = "/tmp/nvme"\ncolour = "red"\n'
        '[s3]\nmax_attempts = "many"\n'
        "[polices]\nladder = []\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    msg = str(e.value)
    assert msg.startswith(f"3 problems in {cfg}:"), msg
    for what in ("line 3", "'colour'", "line 5", "max_attempts", "line 6", "'polices'"):
        assert what in msg, what
    from stage_data import fm_here

    r = fm_here("daemon", "--check", "--config", str(cfg))
    lines = r.stderr.splitlines()
    assert r.returncode == 1 and len(lines) == 4, r.stderr  # the count, then one per problem
    assert "line 3" in lines[1] and "line 5" in lines[2] and "line 6" in lines[3]
