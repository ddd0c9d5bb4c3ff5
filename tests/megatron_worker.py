"""A megatron-core training loop on 2 gloo ranks (tensor parallel 2), checkpointing with
megatron-core's own ``dist_checkpointing.save/load`` as its training loop does, but for the
documented line (``sharded_strategy=("fmstore", 1)``) and :func:`resume_dir`.

The model is megatron-core's own tensor-parallel layers (``ColumnParallelLinear`` ->
gelu -> ``RowParallelLinear``; its ``GPTModel`` needs CUDA in its attention), Adam's
state sharded as megatron-core's ``FP32Optimizer`` shards it, each rank's RNG states as a
``ShardedObject`` and the iteration and optimizer hyper-parameters in the common state.

``MODE RUN OUT``: ``ref`` trains 7 steps, saving every 2 (its own run root), writing the
state after step 4 and every loss; ``kill`` saves every 2 steps, writes the state it saved
at step 4 and waits forever (the test SIGKILLs it); ``resume`` restores the newest step
with ``resume_dir`` and trains to step 7, writing the state it restored and the losses.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading

import torch
import torch.distributed as dist

MODE, RUN, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
RANK = int(os.environ["RANK"])
STEPS = 7

dist.init_process_group("gloo")

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedObject  # noqa: E402
from megatron.core.dist_checkpointing.optimizer import (  # noqa: E402
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from megatron.core.model_parallel_config import ModelParallelConfig  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402

from fmstore.checkpoint.layout import step_name  # noqa: E402
from fmstore.integrations.megatron import close, local_dir, resume_dir  # noqa: E402

ps.initialize_model_parallel(tensor_model_parallel_size=2)
torch.manual_seed(0)
random.seed(0)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        cfg = ModelParallelConfig(
            tensor_model_parallel_size=2, use_cpu_initialization=True, params_dtype=torch.float32
        )
        init = torch.nn.init.normal_
        self.c = ColumnParallelLinear(
            8, 16, config=cfg, init_method=init, gather_output=False, bias=True
        )
        self.r = RowParallelLinear(
            16,
            8,
            config=cfg,
            init_method=init,
            input_is_parallel=True,
            bias=True,
            skip_bias_add=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.c(x)
        y, _ = self.r(torch.nn.functional.gelu(h))
        return y

    def sharded_state_dict(self) -> dict:
        meta = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
        out: dict = {}
        for name in ("c", "r"):
            out.update(getattr(self, name).sharded_state_dict(prefix=f"{name}.", metadata=meta))
        return out


model = Net()
opt = torch.optim.Adam(model.parameters(), lr=0.01)


def sharded_state(iteration: int, loading: bool = False) -> dict:
    """The training loop's sharded state dict (megatron.training's ``generate_state_dict``
    shape): the model, the optimizer as ``FP32Optimizer.sharded_state_dict`` builds it, this
    rank's RNG states, and plain values that go to ``common.pt``."""
    model_sd = model.sharded_state_dict()
    if loading:  # FP32Optimizer's init_state_fn for Adam: the state the load fills
        for p in model.parameters():
            opt.state[p].setdefault("exp_avg", torch.zeros_like(p))
            opt.state[p].setdefault("exp_avg_sq", torch.zeros_like(p))
            opt.state[p].setdefault("step", torch.tensor(0.0))
    osd = opt.state_dict()
    id_map = get_param_id_to_sharded_param_map(model_sd, list(model.parameters()))
    step = next(iter(osd["state"].values()))["step"]
    optim_state_to_sharding_state(osd, id_map, exclude_keys=("step",))
    osd["state"]["common_step"] = step
    rng = {"random": random.getstate(), "torch": torch.get_rng_state()}
    world = dist.get_world_size()
    return {
        "model": model_sd,
        "optimizer": osd,
        "rng_state": ShardedObject("rng_state", rng, (world,), (RANK,), replica_id=0),
        "iteration": iteration,
    }


def apply(state: dict) -> int:
    model.load_state_dict(state["model"], strict=True)
    osd = state["optimizer"]
    step = osd["state"].pop("common_step")
    for s in osd["state"].values():
        s["step"] = step.clone()
    opt.load_state_dict(osd)
    random.setstate(state["rng_state"]["random"])
    torch.set_rng_state(state["rng_state"]["torch"])
    return int(state["iteration"])


def snapshot(iteration: int) -> dict:
    return {
        "iteration": iteration,
        "model": {k: v.detach().clone() for k, v in model.state_dict().items() if v is not None},
        "optim": {
            n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()
        },
        "torch_rng": torch.get_rng_state(),
        "random": random.getstate()[1][:8],
    }


def train_step(iteration: int) -> float:
    g = torch.Generator().manual_seed(iteration)  # the data of this step
    x = torch.randn(4, 8, generator=g)
    y = torch.randn(4, 8, generator=g)
    x = x + 0.1 * torch.randn(4, 8) + random.random()  # the RNGs the checkpoint carries
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.item())


def save(iteration: int) -> None:
    ckpt_dir = local_dir(f"{RUN}/{step_name(iteration)}")
    if RANK == 0:
        os.makedirs(ckpt_dir, exist_ok=True)  # as megatron.training's ensure_directory_exists
    dist.barrier()
    dist_checkpointing.save(sharded_state(iteration), ckpt_dir, sharded_strategy=("fmstore", 1))


start = 0
if MODE == "resume":
    ckpt_dir = resume_dir(RUN)
    assert ckpt_dir is not None, "nothing to resume"
    # megatron.training's load path: the directory check, the common state, then the load
    assert dist_checkpointing.check_is_distributed_checkpoint(ckpt_dir)
    common = dist_checkpointing.load_common_state_dict(ckpt_dir)
    state = dist_checkpointing.load(
        sharded_state(common["iteration"], loading=True),
        ckpt_dir,
        sharded_strategy=("fmstore", 1),
    )
    start = apply(state)
    torch.save(snapshot(start), f"{OUT}/restored_{RANK}.pt")

losses: dict[int, float] = {}
for it in range(start + 1, STEPS + 1):
    losses[it] = train_step(it)
    if it % 2 == 0:
        save(it)
        if it == 4 and MODE in ("ref", "kill"):
            torch.save(snapshot(it), f"{OUT}/{MODE}_saved_{RANK}.pt")
        if it == 4 and MODE == "kill":
            with open(f"{OUT}/waiting_{RANK}", "w"):
                pass
            threading.Event().wait()  # SIGKILLed here, step 4 committed
if RANK == 0:
    with open(f"{OUT}/losses_{MODE}.json", "w") as f:
        json.dump(losses, f)
close()
dist.destroy_process_group()
