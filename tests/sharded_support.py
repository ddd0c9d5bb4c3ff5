"""What the tests of sharded checkpoints share: the config of a node (its own state
directory and NVMe, one shared ``lustre``), a DTensor state sharded over the world and its
comparison (tests/test_sharded_recovery.py and those built on its ranks), and the bit-exact
comparison of nested state trees (tests/test_dcp.py and its multi-node kin)."""

from __future__ import annotations

from typing import Any

import torch


def config_text(tmp: str, node: str, *, state: str = "state", replicas: int = 1) -> str:
    return (
        f'state_dir = "{tmp}/{node}/{state}"\n'
        f'[tiers.nvme]\nurl = "{tmp}/{node}/nvme"\nscope = "node"\nreplicas = {replicas}\n'
        f'[tiers.lustre]\nurl = "{tmp}/lustre"\n'
    )


def make_state(step: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(step)
    full = torch.randn(dist.get_world_size() * 1024, generator=g)
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": step}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return bool(torch.equal(a["w"].to_local(), b["w"].to_local()) and a["step"] == b["step"])


def equal_trees(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            equal_trees(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            equal_trees(x, y, f"{path}.{i}")
    else:
        assert a == b, path
