"""Closed form for nn.Conv1d / Conv2d / Conv3d: unfold the input, then as Linear.

Supports any stride, dilation, groups, numeric or 'same'/'valid' padding and every
padding mode. The patches of the input are unfolded chunk by chunk (never the whole
batch at once) because they are kernel-size times larger than the input.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Call, Context, ModuleGrads, Rule, Unsupported, first_input
from .linear import OuterProductGrads, weight_and_bias


def _pads(module: nn.modules.conv._ConvNd) -> list[int]:
    """F.pad amounts (last spatial dim first) equivalent to the module's padding."""
    n = len(module.kernel_size)
    if module.padding == "valid":
        per_dim = [(0, 0)] * n
    elif module.padding == "same":
        # same split as PyTorch: the extra element of an odd total goes to the right
        totals = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size)]
        per_dim = [(t // 2, t - t // 2) for t in totals]
    else:
        per_dim = [(p, p) for p in module.padding]
    return [p for pair in reversed(per_dim) for p in pair]


def unfold(x: Tensor, module: nn.modules.conv._ConvNd) -> Tensor:
    """Input patches (b, groups, L, C_in/groups · ∏kernel) of a conv, L output positions.

    The patch layout matches the weight (C_out, C_in/groups, *kernel) flattened per group.
    """
    n = len(module.kernel_size)
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    pads = _pads(module)
    if any(pads):
        x = F.pad(x, pads, mode=mode)
    for j, (k, s, d) in enumerate(zip(module.kernel_size, module.stride, module.dilation)):
        # sliding windows of span d(k-1)+1, then every d-th element: dilation for free
        x = x.unfold(2 + j, d * (k - 1) + 1, s)
        if d > 1:
            x = x[..., ::d]
    b, channels = x.shape[:2]
    positions = math.prod(x.shape[2 : 2 + n])
    # (b, C, O₁…Oₙ, k₁…kₙ) -> (b, O₁…Oₙ, C, k₁…kₙ) -> (b, groups, L, C/groups·∏k)
    x = x.permute(0, *range(2, 2 + n), 1, *range(2 + n, 2 + 2 * n))
    x = x.reshape(b, positions, module.groups, -1)
    return x.transpose(1, 2)


class ConvRule(Rule):
    """nn.Conv1d / Conv2d / Conv3d (batched input (B, C, *spatial))."""

    def grads(self, calls: list[Call], ctx: Context) -> ModuleGrads:
        module = self.module
        n = len(module.kernel_size)
        dtype = next(iter(self.params.values())).dtype
        groups = module.groups
        xs, gs = [], []
        for call in calls:
            x = first_input(call)
            if x.dim() != n + 2:
                raise Unsupported(f"its input is {x.dim()}-D; give it a batch dimension at dim 0")
            g = self._grad(call, ctx, dtype)
            # (B, C_out, *out) -> (B, groups, L, C_out/groups)
            gs.append(g.reshape(g.shape[0], groups, module.out_channels // groups, -1))
            xs.append(x)
        positions = sum(g.shape[-1] for g in gs)

        def patches(lo: int, hi: int) -> tuple[Tensor, Tensor]:
            px = [unfold(x[lo:hi].to(dtype), module) for x in xs]
            pg = [g[lo:hi].transpose(-1, -2) for g in gs]
            return (px[0], pg[0]) if len(px) == 1 else (torch.cat(px, 2), torch.cat(pg, 2))

        in_per_group = module.in_channels // groups * math.prod(module.kernel_size)
        return OuterProductGrads(
            patches,
            (groups, positions, in_per_group, module.out_channels // groups),
            weight_and_bias(self.params),
            {name: p.shape for name, p in self.params.items()},
            dtype,
            ctx,
            step=ctx.chunk_size,  # unfolded patches are ∏kernel times the input: chunk them
        )
