"""float8 training of the transformer blocks' linear layers, through torchao.

torchao's ``Float8Linear`` casts a linear's input, weight and output gradient to float8 with dynamic
scales and multiplies them with ``torch._scaled_mm``. Two of torchao's recipes (parallel.float8_recipe):

- tensorwise: one scale per tensor. Under FSDP2 the weights are also all-gathered in float8 (half
  the bytes of bf16), and their scales are computed for every block at once after each optimizer
  step instead of one small all-reduce per weight.
- rowwise: one scale per row of each matmul's left operand and per column of its right one (along
  the dimension the matmul sums over), rounded down to a power of two, and e4m3 for the gradients
  too; torchtitan's choice for convergence. torchao's float8 all-gather is tensorwise only, so the
  weights are all-gathered in high precision and cast after, with no weight scales to precompute.

The output head and the embedding stay in high precision: the head's logits are the loss's input,
and the embedding is a lookup. Linears whose dimensions are not multiples of 16 stay too, since
``_scaled_mm`` requires them. ``torch._scaled_mm`` needs compute capability 8.9 (Ada, Hopper and
later) for either recipe: torch builds its rowwise CUTLASS kernel for sm_89 as well as sm_90a and
later. Elsewhere torchao's emulation runs the same casts with ordinary matrix multiplies, which
proves numerics on CPU and gains no speed.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather
from torch.distributed.tensor import DTensor

Float8Recipe = Literal["tensorwise", "rowwise"]
# Compute capability of torch._scaled_mm's float8 kernels, tensorwise and rowwise alike.
MIN_CAPABILITY = (8, 9)
# Ray accelerator types (and GPU names) of GPUs below compute capability 8.9: Volta, Turing, Ampere.
_BELOW_SM89 = re.compile(r"^(V100|T4|P100|P4|K80|A100|A800|A10G?|A30|A40|A16|A2|A6000|RTX ?A\d+|RTX ?30\d\d)\b", re.I)
# The dimension torch._scaled_mm's operands must be a multiple of.
_ALIGNMENT = 16


class Float8Unavailable(ValueError):
    """float8 was asked for where it cannot run."""


def accelerator_lacks_float8(accelerator_type: str) -> bool:
    """Whether a Ray accelerator type (``A100``, ``A10G``, ``H100``) names a GPU below sm_89."""
    return bool(_BELOW_SM89.match(accelerator_type.strip()))


def float8_requirement(recipe: str) -> str:
    """The start of the one-line refusal of float8 on a GPU that cannot run ``recipe``."""
    setting = "parallel.float8=true" + (f" with parallel.float8_recipe={recipe}" if recipe != "tensorwise" else "")
    return (f"{setting} needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+ (H100, H200, L4, L40S, "
            f"B200)")


def check_float8_device(device: torch.device, holder: str = "this worker", recipe: str = "tensorwise") -> None:
    """Float8Unavailable (one line, naming ``holder``'s GPU) on a CUDA device below compute capability 8.9."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise Float8Unavailable(
            f"{float8_requirement(recipe)}; {holder}'s {name} is {capability[0]}.{capability[1]}: set "
            f"parallel.float8=false"
        )


def _import_torchao_float8() -> Any:
    # Without a GPU torchao cannot load its CUDA extensions and says so at import, once per library.
    logger = logging.getLogger("torchao")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    finally:
        logger.setLevel(level)
    return float8


def _converts(tensor: int) -> Callable[[nn.Module, str], bool]:
    """Linears inside the transformer blocks whose shapes ``_scaled_mm`` accepts on every rank: with
    tensor parallel each rank multiplies a 1/``tensor`` slice of one of the two dimensions."""
    alignment = _ALIGNMENT * tensor

    def converts(module: nn.Module, name: str) -> bool:
        return (
            isinstance(module, nn.Linear)
            and name.startswith("layers.")
            and module.in_features % alignment == 0
            and module.out_features % alignment == 0
        )

    return converts


def convert_to_float8(
    model: nn.Module, *, emulate: bool, fsdp_all_gather: bool, tensor: int = 1, recipe: Float8Recipe = "tensorwise"
) -> int:
    """Swap the blocks' linears for torchao's ``Float8Linear`` with ``recipe``'s scales (before
    tensor parallel, FSDP and compile) and return how many were converted. ``fsdp_all_gather``
    all-gathers tensorwise weights in float8 (rowwise ones travel in high precision). Under tensor
    parallel the plain column/row-wise plans apply: activations travel between TP ranks in high
    precision and each linear casts its DTensor operands with scales over the whole tensor or row
    (torchao reduces their amaxes across the TP group)."""
    float8 = _import_torchao_float8()
    config = replace(
        float8.Float8LinearConfig.from_recipe_name(recipe),
        enable_fsdp_float8_all_gather=fsdp_all_gather and recipe == "tensorwise",
        emulate=emulate,
    )
    float8.convert_to_float8_training(model, module_filter_fn=_converts(tensor), config=config)
    return sum(isinstance(m, float8.float8_linear.Float8Linear) for m in model.modules())


def _float8_gathered(model: nn.Module) -> bool:
    """Whether any of ``model``'s sharded weights is all-gathered in float8."""
    if "torchao" not in sys.modules:  # nothing can be converted without it
        return False
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return any(
        isinstance(p, DTensor) and isinstance(p.to_local(), WeightWithDynamicFloat8CastTensor)
        for p in model.parameters()
    )


def keep_float8_scales_precomputed(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """When ``model`` all-gathers float8 weights (tensorwise only): the scales of all of them at once
    (one all-reduce of their amaxes over the whole mesh), which the next all-gathers use, now, after
    every optimizer step and after every load of the model's state.

    Now: without a precomputed scale FSDP's pre-all-gather reduces the amax over its own mesh only,
    so under tensor parallel each TP rank would cast its slice of the weight with a scale of its own
    in the first step. The load: DCP's optimizer-state load takes a zero step first (the hook runs
    on the weights still there), then the model's weights are replaced."""
    if not _float8_gathered(model):
        return
    precompute = _import_torchao_float8().precompute_float8_dynamic_scale_for_fsdp
    precompute(model)
    optimizer.register_step_post_hook(lambda *_: precompute(model))
    model.register_load_state_dict_post_hook(lambda *_: precompute(model))


class _BytesAllGather(DefaultAllGather):
    """FSDP2's all-gather, with one-byte floating buffers sent as bytes: gloo has no float8 type."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        if output_tensor.dtype.itemsize == 1 and output_tensor.dtype.is_floating_point:
            output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
        return super().__call__(output_tensor, input_tensor, group, async_op)


def gather_float8_as_bytes(model: nn.Module) -> None:
    """When ``model`` all-gathers float8 weights (tensorwise only): every FSDP unit sends float8
    buffers as bytes (for gloo, the CPU backend)."""
    if not _float8_gathered(model):
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(_BytesAllGather())
