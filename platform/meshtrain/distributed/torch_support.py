"""The torch releases meshtrain runs on, and one path for an FSDP2 API that the oldest of them lacks.

meshtrain supports torch 2.11 up to (not including) 2.14: clusters and vendor images ship their own
torch, and requiring one exact release would make every node reinstall it. Below 2.11, FSDP2, DCP
and flex attention lack what meshtrain calls; ``check_torch`` says so in one line.
"""

from __future__ import annotations

import re

import torch
from torch.distributed.fsdp import FSDPModule

from meshtrain.config import ConfigError

MIN_TORCH = (2, 11)
BELOW_TORCH = (2, 14)


class UnsupportedTorch(ConfigError):
    """The installed torch is outside the range meshtrain supports (a restart cannot fix it)."""


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as ``2.11.0+cu130`` or ``2.13.0.dev20260101``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise UnsupportedTorch(f"cannot read the torch version {version!r}")
    return int(match.group(1)), int(match.group(2))


def check_torch(version: str | None = None) -> None:
    """One line when ``version`` (the installed torch's by default) is outside the supported range."""
    version = version or torch.__version__
    release = torch_release(version)
    if not MIN_TORCH <= release < BELOW_TORCH:
        raise UnsupportedTorch(
            f"torch {version} is not supported: meshtrain needs torch>={MIN_TORCH[0]}.{MIN_TORCH[1]},"
            f"<{BELOW_TORCH[0]}.{BELOW_TORCH[1]}; install one (pip install 'torch>={MIN_TORCH[0]}.{MIN_TORCH[1]},"
            f"<{BELOW_TORCH[0]}.{BELOW_TORCH[1]}')"
        )


def reset_iteration(model: FSDPModule) -> None:
    """Drop an FSDP2 root's state of an iteration that raised mid-forward or mid-backward: in-flight
    collectives waited on, parameters resharded, gradients accumulated for a deferred HSDP
    all-reduce discarded, per-iteration trackers cleared.

    torch 2.13 ships this as ``FSDPModule.reset_iter_state``; torch 2.11 and 2.12 keep the same state
    under the same private names, and the fallback clears it the way 2.13 does.
    """
    if hasattr(model, "reset_iter_state"):
        model.reset_iter_state()
        return
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    state = model._get_fsdp_state()
    stream = state._device_handle.current_stream()
    comm = state._comm_ctx
    if comm.all_gather_state is not None and comm.all_gather_state.event is not None:
        stream.wait_event(comm.all_gather_state.event)
    comm.all_gather_state = None
    # 2.11 keeps one pending reduce-scatter; later releases a list of them.
    pending = list(getattr(comm, "reduce_scatter_states", ())) + [getattr(comm, "reduce_scatter_state", None)]
    for reduce_scatter in pending:
        if reduce_scatter is not None and reduce_scatter.event is not None:
            stream.wait_event(reduce_scatter.event)
    if hasattr(comm, "reduce_scatter_states"):
        comm.reduce_scatter_states.clear()
    if hasattr(comm, "reduce_scatter_state"):
        comm.reduce_scatter_state = None
    comm.post_forward_order.clear()
    for module_state in state._state_ctx.all_states:
        module_state._modules_to_run_forward.clear()
        module_state._training_state = TrainingState.IDLE
        # 2.11 keeps one parameter group per state; later releases a list.
        groups = getattr(module_state, "_fsdp_param_groups", None) or [module_state._fsdp_param_group]
        for group in groups:
            if group is not None:
                _reset_param_group(group, stream)
    state._state_ctx.iter_forward_root = None
    state._state_ctx.post_backward_final_callback_queued = False


def _reset_param_group(group: object, stream: torch.Stream) -> None:
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    result = group._all_gather_result  # type: ignore[attr-defined]
    if result is not None:
        if result.all_gather_event is not None:
            stream.wait_event(result.all_gather_event)
        if isinstance(result.all_gather_work, torch.distributed.distributed_c10d.Work):
            result.all_gather_work.wait()
        group._all_gather_result = None  # type: ignore[attr-defined]
    if group._post_reduce_event is not None:  # type: ignore[attr-defined]
        stream.wait_event(group._post_reduce_event)  # type: ignore[attr-defined]
        group._post_reduce_event = None  # type: ignore[attr-defined]
    reduce_state = group._all_reduce_state  # type: ignore[attr-defined]
    if reduce_state is not None and reduce_state.event is not None:
        stream.wait_event(reduce_state.event)
    group._all_reduce_state = None  # type: ignore[attr-defined]
    if group._reshard_after_forward_event is not None:  # type: ignore[attr-defined]
        group._wait_all_gather_streams_on_event(group._reshard_after_forward_event)  # type: ignore[attr-defined]
        group._reshard_after_forward_event = None  # type: ignore[attr-defined]
    group._partial_reduce_output = None  # type: ignore[attr-defined]
    group._post_forward_indices.clear()  # type: ignore[attr-defined]
    group._training_state = TrainingState.IDLE  # type: ignore[attr-defined]
    group._to_sharded()  # type: ignore[attr-defined]
