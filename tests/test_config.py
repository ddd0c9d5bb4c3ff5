from __future__ import annotations

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
