"""The deployment files hold together without a cluster or Docker: every namespace and
service account the Kubernetes manifests use is defined in them, the image they run is the
one the Dockerfile's build command tags, and everything the Dockerfile copies exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
DOCKERFILE = ROOT / "Dockerfile"


def documents() -> list[dict]:
    docs = []
    for path in MANIFESTS:
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def pod_specs(doc: dict) -> list[dict]:
    """The pod specs of a workload (DaemonSet, Deployment, Job, CronJob, Pod)."""
    spec = doc.get("spec") or {}
    if doc["kind"] == "Pod":
        return [spec]
    if doc["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    template = spec.get("template")
    return [template["spec"]] if template else []


def images() -> set[str]:
    """The images of fmstore's own workloads (the trainer's image is the user's)."""
    found = set()
    for doc in documents():
        if doc["kind"] != "DaemonSet":
            continue
        for pod in pod_specs(doc):
            for c in pod.get("initContainers", []) + pod.get("containers", []):
                found.add(c["image"])
    return found


def dockerfile_lines() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return [
        ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")
    ]


def test_the_manifests_parse_and_define_what_they_use():
    docs = documents()
    assert docs, "no Kubernetes manifests under deploy/kubernetes"
    namespaces = {d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"}
    accounts = {
        (d["metadata"].get("namespace", "default"), d["metadata"]["name"])
        for d in docs
        if d["kind"] == "ServiceAccount"
    }
    used_accounts = 0
    for d in docs:
        ns = d["metadata"].get("namespace")
        if d["kind"] != "Namespace":
            assert ns in namespaces, f"{d['kind']} {d['metadata']['name']}: namespace {ns!r}"
        for pod in pod_specs(d):
            sa = pod.get("serviceAccountName")
            if sa is not None:
                used_accounts += 1
                assert (ns, sa) in accounts, f"service account {sa!r} in {ns!r} is not defined"
    assert used_accounts, "the daemon runs under a service account of its own"


def test_the_service_account_carries_an_iam_role_for_s3():
    (sa,) = [d for d in documents() if d["kind"] == "ServiceAccount"]
    arn = sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"]
    assert re.fullmatch(r"arn:aws:iam::\d{12}:role/[\w+=,.@/-]+", arn), arn


def build_tag() -> str:
    """The tag of the build command documented in the Dockerfile (``docker build -t T .``)."""
    commands = [
        ln.lstrip("# ").strip()
        for ln in DOCKERFILE.read_text().splitlines()
        if ln.lstrip("# ").startswith("docker build")
    ]
    assert len(commands) == 1, commands
    argv = shlex.split(commands[0])
    return argv[argv.index("-t") + 1]


def test_the_manifests_run_the_image_the_dockerfile_builds():
    tag = build_tag()
    assert images() == {tag}
    labels = " ".join(ln for ln in dockerfile_lines() if ln.startswith("LABEL"))
    assert f'io.fmstore.image="{tag}"' in labels


def test_the_dockerfile_builds_fmstore_from_this_tree():
    lines = dockerfile_lines()
    assert lines[0] == "FROM python:3.11-slim"
    assert any("download.pytorch.org/whl/cpu" in ln for ln in lines if ln.startswith("RUN"))
    assert any(re.search(r"pip install .*\s\.(\s|$)", ln) for ln in lines if ln.startswith("RUN"))
    assert 'ENTRYPOINT ["fmstore"]' in lines
    # The manifests' args replace CMD; without them the image runs the daemon.
    assert lines[-1] == 'CMD ["daemon", "--config", "/etc/fmstore/fmstore.toml"]'


@pytest.mark.parametrize(
    "copy", [ln for ln in dockerfile_lines() if ln.startswith(("COPY", "ADD"))] or ["none"]
)
def test_every_file_the_dockerfile_copies_exists(copy):
    assert copy != "none", "the Dockerfile copies nothing"
    argv = [a for a in shlex.split(copy)[1:] if not a.startswith("--")]
    for src in argv[:-1]:
        assert (ROOT / src).exists(), f"{copy}: {src} is not in the repository"
    ignored = (
        (ROOT / ".dockerignore").read_text().split() if (ROOT / ".dockerignore").exists() else []
    )
    for src in argv[:-1]:
        assert src not in ignored, f"{copy}: {src} is excluded by .dockerignore"


def _env(container: dict, node_name: str) -> dict[str, str]:
    """A container's environment as the kubelet resolves it on node ``node_name`` (values,
    and the downward API's ``spec.nodeName``; anything else fails the test)."""
    out = {}
    for e in container.get("env", []):
        if "value" in e:
            out[e["name"]] = str(e["value"])
        else:
            assert e["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName", e
            out[e["name"]] = node_name
    return out


def test_trainer_and_daemon_agree_on_the_node_and_the_config_is_valid(tmp_path, monkeypatch):
    """The ConfigMap's TOML loads through fmstore's own loader and policy rules with NVMe
    node-local; the trainer Job's and the daemon's pods on node ``a`` have the same node id
    (from ``spec.nodeName``), the trainer finds the config where the ConfigMap is mounted."""
    from fmstore.checkpoint.dcp.nodes import node_id
    from fmstore.config import load_config
    from fmstore.tiering.policy.rules import from_config

    docs = documents()
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    path = tmp_path / "fmstore.toml"
    path.write_text(cm["data"]["fmstore.toml"])
    cfg = load_config(str(path))
    assert cfg.tier("nvme").scope == "node"
    pol = from_config(cfg)  # the policy rules: no every_seconds from a node-local source
    assert pol.write_tier == "nvme"
    (daemon,) = [d for d in docs if d["kind"] == "DaemonSet"]
    (job,) = [d for d in docs if d["kind"] == "Job"]
    ids = {}
    for name, doc in (("daemon", daemon), ("trainer", job)):
        (pod,) = pod_specs(doc)
        mounts = {v["name"]: v for v in pod["volumes"]}
        assert mounts["config"]["configMap"]["name"] == cm["metadata"]["name"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            env = _env(c, "a")
            assert "FMSTORE_NODE_ID" in env, f"{name}/{c['name']} sets no FMSTORE_NODE_ID"
            for k, v in env.items():
                monkeypatch.setenv(k, v)
            ids[f"{name}/{c['name']}"] = node_id()
            if name == "trainer":
                (m,) = [m for m in c["volumeMounts"] if m["name"] == "config"]
                assert env["FMSTORE_CONFIG"] == f"{m['mountPath']}/fmstore.toml"
    assert set(ids.values()) == {"a"}, ids
