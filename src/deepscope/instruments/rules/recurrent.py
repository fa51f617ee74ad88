"""Closed form for nn.LSTM: per-sample gradients as sums of outer products over time.

For layer l (and direction), step t, the gate pre-activations are
    zₜ = W_ih xₜ + b_ih + W_hh hₜ₋₁ + b_hh
so with δₜ = ∂L/∂zₜ, per sample i:
    gᵢ(W_ih) = Σₜ δᵢₜ xᵢₜᵀ    gᵢ(W_hh) = Σₜ δᵢₜ hᵢ,ₜ₋₁ᵀ    gᵢ(b_ih) = gᵢ(b_hh) = Σₜ δᵢₜ
— the Linear layer's form (`OuterProductGrads`) with the T steps as positions. The δₜ of
every sample come from one backward pass of the captured output gradients through an
unrolled re-run of the whole batch (samples never mix in an LSTM), with the parameters as
they were at forward time. A re-run that does not reproduce the recorded output is
reported, as for the generic rule. Configurations this form does not cover (proj_size,
dropout between layers in train mode) use the generic rule.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from ...hookstate import paused
from .base import Call, Context, ModuleGrads, Part, Unsupported, first_input
from .generic import RNNRule
from .linear import OuterProductGrads


class CombinedGrads(ModuleGrads):
    """One module's statistics from several ModuleGrads over disjoint parameter names."""

    def __init__(self, members: list[ModuleGrads], ctx: Context) -> None:
        shapes = {name: shape for m in members for name, shape in m.shapes.items()}
        super().__init__(shapes, members[0].dtype, ctx)
        self.members = members

    def _merged(self, get) -> dict[str, Tensor]:
        return {name: value for m in self.members for name, value in get(m).items()}

    def per_sample(self, lo: int, hi: int) -> dict[str, Tensor]:
        return self._merged(lambda m: m.per_sample(lo, hi))

    def sq_norms(self) -> dict[str, Tensor]:
        return self._merged(lambda m: m.sq_norms())

    def grad_sum(self, observed: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        return self._merged(lambda m: m.grad_sum(observed))

    def second_moments(self) -> dict[str, Tensor]:
        return self._merged(lambda m: m.second_moments())

    def dots(self, vector_sets: Sequence[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
        out: list[dict[str, Tensor]] = [{} for _ in vector_sets]
        for m in self.members:
            own = [{n: v for n, v in vs.items() if n in m.shapes} for vs in vector_sets]
            for k, dots in enumerate(m.dots(own)):
                out[k].update(dots)
        return out

    def parts(self) -> Iterator[dict[str, Part]]:
        for m in self.members:
            yield from m.parts()


class LSTMRule(RNNRule):
    """nn.LSTM (any layers, bidirectional, batch_first or not, with or without (h₀, c₀)):
    the closed form above; other configurations fall back to the generic rule."""

    def _closed_form(self) -> bool:
        module = self.module
        dropout = module.training and module.dropout > 0 and module.num_layers > 1
        return module.proj_size == 0 and not dropout and set(self.params) == {
            name for name, _ in module.named_parameters()}

    def grads(self, calls: list[Call], ctx: Context) -> ModuleGrads:
        if not self._closed_form():
            return super().grads(calls, ctx)
        dtype = next(iter(self.params.values())).dtype
        per_call = [self._patches(call, ctx, dtype) for call in calls]
        members: list[ModuleGrads] = []
        for ih, hh in _weight_names(self.module):
            for w, which in ((ih, 0), (hh, 1)):  # W_ih pairs δ with inputs, W_hh with states
                bias = w.replace("weight", "bias")
                bias = bias if bias in self.params else None
                # several calls: their steps are concatenated (their gradients add up)
                xs = [found[ih][which] for found in per_call]
                gs = [found[ih][2] for found in per_call]
                x_all = (xs[0] if len(xs) == 1 else torch.cat(xs, 1)).unsqueeze(1)
                g_all = (gs[0] if len(gs) == 1 else torch.cat(gs, 1)).unsqueeze(1)
                members.append(OuterProductGrads(
                    lambda lo, hi, x=x_all, g=g_all: (x[lo:hi], g[lo:hi]),
                    (1, x_all.shape[2], x_all.shape[3], g_all.shape[3]), (w, bias),
                    {n: self.params[n].shape for n in (w, bias) if n},
                    dtype, ctx, step=x_all.shape[0]))
        return CombinedGrads(members, ctx)

    def _patches(self, call: Call, ctx: Context, dtype: torch.dtype
                 ) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
        """weight_ih name -> (layer inputs (B, T, I), previous states (B, T, H), δ (B, T, 4H))
        of one call, from an unrolled re-run and one backward pass."""
        module = self.module
        x = first_input(call).to(dtype)
        if x.dim() != 3:
            raise Unsupported("its input is unbatched (2-D)")
        if module.batch_first is False:
            x = x.transpose(0, 1)
        hx = call.args[1] if len(call.args) > 1 else call.kwargs.get("hx")
        params, _ = call.extra  # copies as at forward time
        batch = x.shape[0]
        states = module.num_layers * (2 if module.bidirectional else 1)
        zeros = x.new_zeros(states, batch, module.hidden_size)
        h0, c0 = ((zeros, zeros) if hx is None else
                  (hx[0].to(dtype), hx[1].to(dtype)))
        names = _weight_names(module)
        per_layer = len(names) // module.num_layers
        with paused(), torch.enable_grad():
            layer_in = x
            found: dict[str, tuple[Tensor, Tensor, Tensor]] = {}
            pres, outs_h, outs_c, entries = [], [], [], []
            for layer in range(module.num_layers):
                directions = []
                for d in range(per_layer):
                    k = layer * per_layer + d
                    ih, hh = names[k]
                    pre = layer_in @ params[ih].T
                    if ih.replace("weight", "bias") in params:
                        pre = pre + params[ih.replace("weight", "bias")] \
                            + params[hh.replace("weight", "bias")]
                    out, prev, h_n, c_n, z = _unroll(pre, params[hh], h0[k], c0[k], d == 1)
                    pres.append(z)
                    entries.append((ih, layer_in, prev))
                    outs_h.append(h_n)
                    outs_c.append(c_n)
                    directions.append(out)
                layer_in = directions[0] if len(directions) == 1 else torch.cat(directions, 2)
            output = layer_in if module.batch_first else layer_in.transpose(0, 1)
            rerun = [output, torch.stack(outs_h), torch.stack(outs_c)]
            self._check_rerun(call, rerun, ctx)
            pairs = [(rerun[j], g.to(dtype) * ctx.scale) for j, g in zip(call.out_index, call.grads)
                     if g is not None]
            deltas = torch.autograd.grad([p for p, _ in pairs], pres, [g for _, g in pairs],
                                         allow_unused=True)
        for (ih, inputs, prev), z, delta in zip(entries, pres, deltas):
            delta = torch.zeros_like(z) if delta is None else delta
            found[ih] = (inputs.detach(), prev.detach(), delta.transpose(0, 1))
        return found

    def _check_rerun(self, call: Call, rerun: list[Tensor], ctx: Context) -> None:
        for j, recorded, version in zip(call.out_index, call.outputs, call.out_versions):
            if recorded._version != version:
                continue
            ref, out = recorded.to(rerun[j].dtype), rerun[j].detach()
            tol = 1e-3 * float(ref.abs().max()) if ref.numel() else 0.0
            if out.shape != ref.shape or not torch.allclose(out, ref, rtol=1e-3, atol=tol):
                ctx.warn("re-running it did not reproduce its recorded output (state changed "
                         "since the forward): its per-sample gradients are unreliable")
                return


def _weight_names(module: torch.nn.LSTM) -> list[tuple[str, str]]:
    """(weight_ih, weight_hh) names per layer and direction, in the order of h_n."""
    suffixes = ["", "_reverse"] if module.bidirectional else [""]
    return [(f"weight_ih_l{layer}{s}", f"weight_hh_l{layer}{s}")
            for layer in range(module.num_layers) for s in suffixes]


def _unroll(pre: Tensor, w_hh: Tensor, h: Tensor, c: Tensor, reverse: bool
            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One LSTM layer direction over pre-activations `pre` (B, T, 4H) without the hidden
    part. Returns (outputs (B, T, H), the state each step read (B, T, H), h_n, c_n, the
    leaf z (T, B, 4H) standing for `pre` whose gradient is δ)."""
    z = pre.transpose(0, 1).contiguous()  # (T, B, 4H): ∂L/∂z[t] is δₜ
    if not z.requires_grad:  # the first layer: inputs and parameter copies need no grad
        z.requires_grad_()
    steps = range(z.shape[0] - 1, -1, -1) if reverse else range(z.shape[0])
    outs: list[Tensor] = [h] * z.shape[0]
    prevs: list[Tensor] = [h] * z.shape[0]
    for t in steps:
        prevs[t] = h
        gates = z[t] + h @ w_hh.T
        i, f, g, o = gates.chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outs[t] = h
    return torch.stack(outs, 1), torch.stack(prevs, 1), h, c, z
