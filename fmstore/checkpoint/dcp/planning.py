"""DCP's planners run on each rank alone, where their global step has nothing to decide.

``dcp.load`` gathers every rank's load plan on the coordinator, runs the planner's global
step and scatters the plans back, then gathers every rank's outcome: messages whose size
grows with the world (every rank's read items pass through the coordinator).  The default
load planner's global step passes the plans through unchanged (torch's
``create_default_global_load_plan``), and so does fmstore's Reader, so a rank's plan is the
same whether it is planned with the others or alone.  fmstore's restore then plans each
rank alone (:func:`plan_here`), agrees that every rank planned (so that a planner's error
on one rank leaves every rank's state untouched, as DCP's collective plan does), reads,
and agrees on the outcome, each agreement one bounded message of its own
(``collective._try``).  A planner with its own global step keeps DCP's collective load.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any


def plans_alone(planner: Any) -> bool:
    """Whether ``planner``'s global load step passes the ranks' plans through unchanged
    (None: DCP's default planner), so that each rank may plan alone."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    if planner is None:
        return True
    own = type(planner).create_global_plan
    return isinstance(planner, DefaultLoadPlanner) and own is DefaultLoadPlanner.create_global_plan


def _as_dcp(step: str, rank: int, e: BaseException) -> BaseException:
    """``e`` as DCP's collective load raises it (its ``CheckpointException`` naming this
    rank), so that :func:`~fmstore.protocol.problems.code_of` reads it the same way."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, (KeyboardInterrupt, SystemExit)):
        return e
    return CheckpointException(step, {rank: (e, traceback.extract_tb(e.__traceback__))})


def plan_here(
    state_dict: dict[str, Any], reader: Any, planner: Any, rank: int
) -> Callable[[], None]:
    """This rank's part of DCP's load of ``state_dict`` through ``reader``, planned alone
    (for a planner :func:`plans_alone` accepts; as ``dcp.load`` does with its ``Stateful``
    values): returns the read, which loads the values in place.  Nothing is loaded before
    the read, so the caller runs it once every rank planned."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.stateful import Stateful

    planner = planner if planner is not None else DefaultLoadPlanner()
    keys = sorted(state_dict)  # the order dcp.load loads in
    values = {
        k: v.state_dict() if isinstance(v, Stateful) else v for k in keys for v in [state_dict[k]]
    }
    try:
        metadata = reader.read_metadata()
        planner.set_up_planner(values, metadata, rank == 0)
        reader.set_up_storage_reader(metadata, rank == 0)
        plan = reader.prepare_local_plan(planner.create_local_plan())
        plan = reader.prepare_global_plan(planner.create_global_plan([plan]))[0]
        plan = planner.finish_plan(plan)
    except BaseException as e:
        raise _as_dcp("plan", rank, e) from None

    def read() -> None:
        try:
            reader.read_data(plan, planner).wait()
        except BaseException as e:
            raise _as_dcp("read", rank, e) from None
        for k in keys:
            v = state_dict[k]
            if isinstance(v, Stateful):
                v.load_state_dict(values[k])
            else:
                state_dict[k] = values[k]

    return read
