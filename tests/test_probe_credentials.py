"""The tier probe's per-node result is keyed by the credentials (issue 60, item 5): a
``daemon --check`` with a wrong secret does not stand for trainers with the right keys,
nor a good probe for a process with bad keys; the secret itself is never written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from fmstore.config import load_config
from fmstore.tiering.policy.policies import from_config
from fmstore.tiering.probe import MARKER_NAME, probe_once_per_node

ENV = {**os.environ, "PYTHONPATH": os.getcwd()}
PROBE = (
    "import sys, json; from fmstore.config import load_config; "
    "from fmstore.tiering.policy.policies import from_config; "
    "from fmstore.tiering.probe import probe_once_per_node; "
    "c = load_config(sys.argv[1]); r = probe_once_per_node(c, from_config(c)); "
    "print(json.dumps([r.cached, [p.error for p in r.problems]]))"
)


def test_a_wrong_secret_neither_poisons_nor_hides(tmp_path, s3_server, s3_bucket, monkeypatch):
    cfg = tmp_path / "fmstore.toml"
    cfg.write_text(
        f'state_dir = "{tmp_path / "state"}"\n'
        f'[tiers.nvme]\nurl = "{tmp_path / "nvme"}"\n'
        f'[tiers.s3]\nurl = "s3://{s3_bucket}/ckpt"\nendpoint_url = "{s3_server.endpoint_url}"\n'
        f'region = "{s3_server.region}"\naddressing_style = "path"\nmax_attempts = 1\n'
        '[[policies.export]]\nto = "s3"\nevery_saves = 1\n'
    )
    good = {k: v for k, v in s3_server.env().items() if "ENDPOINT" not in k}
    bad = {**good, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    base = {k: v for k, v in ENV.items() if not k.startswith("AWS_")}

    # an operator's check with a wrong secret fails, and its result is cached
    check = subprocess.run(
        [sys.executable, "-m", "fmstore", "daemon", "--check", "-c", str(cfg)],
        env={**base, **bad},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 1 and "tier s3" in check.stderr, check.stderr
    marker = (tmp_path / "state" / MARKER_NAME).read_text()
    assert "not-the-secret" not in marker and good["AWS_SECRET_ACCESS_KEY"] not in marker

    # a trainer with the right keys probes for itself: no SignatureDoesNotMatch of another's
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    for k, v in good.items():
        monkeypatch.setenv(k, v)
    config = load_config(str(cfg))
    rep = probe_once_per_node(config, from_config(config))
    assert not rep.cached and rep.ok, rep.problems
    assert probe_once_per_node(config, from_config(config)).cached  # the same keys: reused

    # and a process with the bad keys is not told the good probe's "ok"
    again = subprocess.run(
        [sys.executable, "-c", PROBE, str(cfg)],
        env={**base, **bad},
        capture_output=True,
        text=True,
        timeout=120,
    )
    cached, problems = json.loads(again.stdout)
    assert cached is False and problems, again.stderr
    assert "not-the-secret" not in (tmp_path / "state" / MARKER_NAME).read_text()
