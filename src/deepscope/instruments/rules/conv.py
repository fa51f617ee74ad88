"""Closed form for nn.Conv1d / Conv2d / Conv3d: unfold the input, then as Linear.

Supports any stride, dilation, groups, numeric or 'same'/'valid' padding and every
padding mode. The patches of the input are unfolded chunk by chunk (never the whole
batch at once) because they are kernel-size times larger than the input; most passes need
none: per-sample weight gradients come from the conv's own weight-gradient kernel (the
samples as groups of one conv), products with vectors from the conv itself.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Call, Context, ModuleGrads, Rule, Unsupported, first_input, samples_per_chunk
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


def _own_padding(module: nn.modules.conv._ConvNd) -> tuple[int, ...] | None:
    """The per-dim zero padding a conv / im2col call can apply itself (no padded copy of the
    input), or None when F.pad must (other modes, an asymmetric 'same')."""
    pads = _pads(module)
    left, right = pads[0::2], pads[1::2]
    if module.padding_mode != "zeros" or left != right:
        return None
    return tuple(reversed(left))


def _padded(x: Tensor, module: nn.modules.conv._ConvNd) -> tuple[Tensor, tuple[int, ...]]:
    """(x, padding left for the conv / im2col call): padded here only when it must be."""
    own = _own_padding(module)
    if own is not None:
        return x, own
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(x, _pads(module), mode=mode), (0,) * len(module.kernel_size)


def unfold(x: Tensor, module: nn.modules.conv._ConvNd) -> Tensor:
    """Input patches (b, groups, L, C_in/groups · ∏kernel) of a conv, L output positions.

    The patch layout matches the weight (C_in/groups, *kernel) flattened per group. Conv1d /
    Conv2d: im2col (`F.unfold`), a transposed view of its result; Conv3d: strided views
    gathered by one copy.
    """
    n = len(module.kernel_size)
    b = x.shape[0]
    if n <= 2:
        x, padding = _padded(x, module)
        one = (1,) * (2 - n)  # Conv1d as a Conv2d of height 1
        zero = (0,) * (2 - n)
        cols = F.unfold(x.reshape(*x.shape[:2], *one, *x.shape[2:]),
                        one + module.kernel_size, dilation=one + module.dilation,
                        padding=zero + padding, stride=one + module.stride)
        return cols.view(b, module.groups, -1, cols.shape[-1]).transpose(2, 3)
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    pads = _pads(module)
    if any(pads):
        x = F.pad(x, pads, mode=mode)
    for j, (k, s, d) in enumerate(zip(module.kernel_size, module.stride, module.dilation)):
        # sliding windows of span d(k-1)+1, then every d-th element: dilation for free
        x = x.unfold(2 + j, d * (k - 1) + 1, s)
        if d > 1:
            x = x[..., ::d]
    channels = x.shape[1]
    positions = math.prod(x.shape[2 : 2 + n])
    # (b, C, O₁…Oₙ, k₁…kₙ) -> (b, O₁…Oₙ, C, k₁…kₙ) -> (b, groups, L, C/groups·∏k)
    x = x.permute(0, *range(2, 2 + n), 1, *range(2 + n, 2 + 2 * n))
    x = x.reshape(b, positions, module.groups, channels // module.groups * math.prod(
        module.kernel_size))
    return x.transpose(1, 2)


class ConvRule(Rule):
    """nn.Conv1d / Conv2d / Conv3d (batched input (B, C, *spatial))."""

    early = True
    channels_at_dim1 = True

    def grads(self, calls: list[Call], ctx: Context) -> ModuleGrads:
        module = self.module
        n = len(module.kernel_size)
        dtype = next(iter(self.params.values())).dtype
        groups = module.groups
        xs, gs = [], []
        outs = []  # each call's output gradient (B, C_out, *out), not scaled
        for call in calls:
            x = first_input(call)
            if x.dim() != n + 2:
                raise Unsupported(f"its input is {x.dim()}-D; give it a batch dimension at dim 0")
            g = self._output_grad(call, dtype)  # scaled by the slice where used
            # (B, C_out, *out) -> (B, groups, L, C_out/groups)
            gs.append(g.reshape(g.shape[0], groups, module.out_channels // groups, -1))
            outs.append(g)
            xs.append(x)
        positions = sum(g.shape[-1] for g in gs)
        scale = ctx.scale

        def patches(lo: int, hi: int) -> tuple[Tensor, Tensor]:
            px = [unfold(x[lo:hi].to(dtype), module) for x in xs]
            pg = [(g[lo:hi] * scale).transpose(-1, -2) for g in gs]
            return (px[0], pg[0]) if len(px) == 1 else (torch.cat(px, 2), torch.cat(pg, 2))

        in_per_group = module.in_channels // groups * math.prod(module.kernel_size)
        conv = (F.conv1d, F.conv2d, F.conv3d)[n - 1]

        def products(lo: int, hi: int, weights: list[Tensor], absolute: bool
                     ) -> tuple[list[Tensor], Tensor]:
            # the conv itself with each weight: no patches formed
            ins = [_padded(x[lo:hi].to(dtype), module) for x in xs]
            ins = [(x.abs(), pad) for x, pad in ins] if absolute else ins
            out = []
            for w in weights:  # (groups, Oₖ, I) -> (groups·Oₖ, C_in/groups, *kernel)
                kernel = w.reshape(-1, module.in_channels // groups, *module.kernel_size)
                ys = [conv(x, kernel, None, module.stride, pad, module.dilation, groups)
                      for x, pad in ins]
                ys = [y.reshape(y.shape[0], groups, w.shape[1], -1) for y in ys]
                out.append((ys[0] if len(ys) == 1 else torch.cat(ys, 3)).transpose(2, 3))
            pg = [(g[lo:hi] * scale).transpose(-1, -2) for g in gs]
            return out, pg[0] if len(pg) == 1 else torch.cat(pg, 2)

        def weight_grads(lo: int, hi: int, per_sample: bool) -> Tensor:
            # the conv's weight-gradient kernel; per sample: the samples as groups of one conv
            total = None
            for x, g in zip(xs, outs):
                x, padding = _padded(x[lo:hi].to(dtype), module)
                b = x.shape[0] if per_sample else 1
                weight = x.new_empty(b * module.out_channels, module.in_channels // groups,
                                     *module.kernel_size)  # only its shape is read
                grad = torch.ops.aten.convolution_backward(
                    (g[lo:hi] * scale).reshape(-1, b * module.out_channels, *g.shape[2:]),
                    x.reshape(-1, b * module.in_channels, *x.shape[2:]), weight,
                    None, module.stride, padding, module.dilation, False, (0,) * n,
                    b * groups, (False, True, False))[1]
                if per_sample:
                    grad = grad.view(b, *self.params["weight"].shape)
                total = grad if total is None else total + grad
            return total

        return OuterProductGrads(
            patches,
            (groups, positions, in_per_group, module.out_channels // groups),
            weight_and_bias(self.params),
            {name: p.shape for name, p in self.params.items()},
            dtype,
            ctx,
            # unfolded patches are ∏kernel times the input: chunk them
            step=samples_per_chunk(ctx.chunk_size, groups * positions * in_per_group),
            products=products,
            weight_grads=weight_grads if "weight" in self.params else None,
        )
