"""Closed forms for affine normalisation layers: LayerNorm, RMSNorm, GroupNorm, BatchNorm.

y = x̂ ∘ γ + β with x̂ the normalised input, so per sample gᵢ(γ) = Σ G ∘ x̂ and gᵢ(β) = Σ G
over the positions sharing one affine element. x̂ is recomputed from the saved input
without the affine part, so no current parameter value is read. The per-sample
gradients are as small as the affine parameters, so they are computed whole.

BatchNorm in eval mode normalises with running statistics (copied at forward time).
BatchNorm that normalises with batch statistics (train mode, or no running statistics)
couples the samples: gᵢ is then each sample's additive share of the batch gradient
(their sum is the true gradient), and the same holds for every layer before it.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from .base import Call, Context, DenseGrads, ModuleGrads, Rule, Unsupported, first_input


class NormRule(Rule):
    """Per-sample gradients of γ / β for nn.LayerNorm, nn.RMSNorm, GroupNorm, BatchNorm*d."""

    early = True

    def __init__(self, module: nn.Module, params: dict[str, nn.Parameter]) -> None:
        super().__init__(module, params)
        self._batch_norm = isinstance(module, nn.modules.batchnorm._BatchNorm)
        self.channels_at_dim1 = self._batch_norm or isinstance(module, nn.GroupNorm)

    def capture(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """BatchNorm: copies of the running statistics it normalised with, or the reason
        it used batch statistics (a str)."""
        module = self.module
        if not self._batch_norm:
            return None
        if module.training:
            return "in train mode"
        if module.running_mean is None:
            return "without running statistics (track_running_stats=False)"
        return module.running_mean.detach().clone(), module.running_var.detach().clone()

    def _normalised(self, x: Tensor, extra: Any) -> tuple[Tensor, int]:
        """(x̂, number of leading dims that are summed per sample incl. the batch dim)."""
        module = self.module
        if isinstance(module, nn.GroupNorm):
            return F.group_norm(x, module.num_groups, eps=module.eps), -1
        if self._batch_norm:
            batch_stats = isinstance(extra, str)
            mean, var = (None, None) if batch_stats else extra
            # no running tensors are passed with batch statistics: nothing gets updated
            xhat = F.batch_norm(x, mean, var, training=batch_stats, eps=module.eps)
            return xhat, -1
        shape = tuple(module.normalized_shape)
        if isinstance(module, nn.LayerNorm):
            return F.layer_norm(x, shape, eps=module.eps), len(shape)
        return F.rms_norm(x, shape, eps=module.eps), len(shape)

    def grads(self, calls: list[Call], ctx: Context) -> ModuleGrads:
        dtype = next(iter(self.params.values())).dtype
        totals: dict[str, Tensor] = {}
        for call in calls:
            if isinstance(call.extra, str):
                ctx.warn(
                    f"{call.extra}: per-sample gradients are ill-defined (samples interact "
                    "through batch statistics); reported values are each sample's additive "
                    "share of the batch gradient, here and in every layer before it"
                )
            x = first_input(call).to(dtype)
            if x.dim() < 2:
                raise Unsupported("its input is 1-D; give it a batch dimension at dim 0")
            g = self._grad(call, ctx, dtype)
            xhat, trailing = self._normalised(x, call.extra)
            per_call = {"weight": g * xhat, "bias": g}
            for name in self.params:
                value = per_call[name]
                if trailing == -1:  # channels at dim 1: sum batch-less spatial dims
                    value = value.reshape(*value.shape[:2], -1).sum(2)
                else:  # affine over the trailing dims: sum everything in between
                    value = value.reshape(value.shape[0], -1, *value.shape[-trailing:]).sum(1)
                totals[name] = totals[name] + value if name in totals else value
        return DenseGrads(totals, ctx)


def rms_norm_type() -> type[nn.Module] | None:
    """nn.RMSNorm where this PyTorch has it (2.4+)."""
    return getattr(nn, "RMSNorm", None)
