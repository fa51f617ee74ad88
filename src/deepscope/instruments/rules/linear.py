"""Closed forms for layers whose weight gradient is a sum of outer products (Linear, Conv).

For sample i, group γ and positions t (sequence steps, or conv output positions):
    gᵢ(W)[γ] = Σₜ G[i,γ,t] X[i,γ,t]ᵀ        gᵢ(b)[γ] = Σₜ G[i,γ,t]
with X the layer input (conv: unfolded patches) and G the gradient w.r.t. the output.
Several calls of one module are concatenated along t, which sums their contributions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from .base import (
    CHUNK_ELEMENTS,
    Call,
    Context,
    ModuleGrads,
    Part,
    RankOne,
    Rule,
    Unsupported,
    first_input,
    samples_per_chunk,
    split_dots,
)

Patches = Callable[[int, int], tuple[Tensor, Tensor]]
# (lo, hi, weights (groups, Oₖ, I) each, absolute) -> ([Σᵢ w[γ, :, i]·x[b, γ, t, i] as
# (b, groups, T, Oₖ) per weight, with |x| when absolute], G (b, groups, T, O))
Products = Callable[[int, int, list[Tensor], bool], tuple[list[Tensor], Tensor]]


class OuterProductGrads(ModuleGrads):
    """Per-sample statistics from patches X (b, groups, T, I) and G (b, groups, T, O).

    `patches(lo, hi)` returns the patches of samples lo..hi-1 in the parameters' dtype,
    with G already scaled to gradients of the per-sample losses. The weight is
    (groups·O, I)-shaped up to a reshape to `shapes[weight]` (`transposed`: (I, O), one
    group, as Hugging Face's Conv1D stores it); the bias (groups·O,).
    `step`: samples per call of `patches` in the passes that need no per-sample gradients
    (the whole batch when the patches are small or views of stored tensors: chunking would
    only add per-call overhead). `products`: the patches times weights without forming the
    patches (a conv's own kernel), for the passes that need only those; default: from the
    patches. `weight_grads(lo, hi, per_sample)`: the weight's per-sample gradients
    (hi - lo, *shape), or their sum, by a faster route than the patches (a conv's
    weight-gradient kernel); default: from the patches.
    """

    def __init__(
        self,
        patches: Patches,
        dims: tuple[int, int, int, int],
        names: tuple[str | None, str | None],
        shapes: dict[str, torch.Size],
        dtype: torch.dtype,
        ctx: Context,
        step: int,
        transposed: bool = False,
        products: Products | None = None,
        weight_grads: Callable[[int, int, bool], Tensor] | None = None,
    ) -> None:
        super().__init__(shapes, dtype, ctx)
        self.patches = patches
        self.products = products or self._patch_products
        self.weight_grads = weight_grads
        self.step = step
        self.transposed = transposed
        self.groups, self.T, self.I, self.O = dims
        self.weight, self.bias = names
        self._sq: dict[str, Tensor] | None = None
        self._sum: dict[str, Tensor] | None = None
        self._m2: dict[str, Tensor] | None = None

    def _elements_per_sample(self) -> int:
        patches = self.groups * self.T * self.I if self.weight_grads is None else 0
        return super()._elements_per_sample() + patches

    def _patch_products(self, lo: int, hi: int, weights: list[Tensor], absolute: bool
                        ) -> tuple[list[Tensor], Tensor]:
        x, g = self.patches(lo, hi)
        x = x.abs() if absolute else x
        if self.groups == 1:  # one matmul each: einsum's planning costs as much on small ones
            rows = x.reshape(-1, self.I)
            return [(rows @ w[0].T).view(*x.shape[:3], -1) for w in weights], g
        return [torch.einsum("bgti,goi->bgto", x, w) for w in weights], g

    def _weight_shaped(self, w: Tensor) -> Tensor:
        """(*lead, groups, O, I) -> (*lead, *weight shape)."""
        lead = w.shape[:-3]
        if self.transposed:
            w = w.transpose(-1, -2)
        return w.reshape(*lead, *self.shapes[self.weight])

    def _weight_goi(self, v: Tensor) -> Tensor:
        """A weight-shaped tensor as (groups, O, I)."""
        if self.transposed:
            return v.reshape(self.I, self.O).T.unsqueeze(0)
        return v.reshape(self.groups, self.O, self.I)

    def per_sample(self, lo: int, hi: int) -> dict[str, Tensor]:
        if self.weight_grads is not None:
            _, g = self.products(lo, hi, [], False)
            out = {self.weight: self.weight_grads(lo, hi, True)} if self.weight else {}
            if self.bias:
                out[self.bias] = g.sum(2).reshape(hi - lo, *self.shapes[self.bias])
            return out
        x, g = self.patches(lo, hi)
        out = {}
        if self.weight:
            equation = "bgto,bgti->bgio" if self.transposed else "bgto,bgti->bgoi"
            gw = torch.einsum(equation, g, x)
            out[self.weight] = gw.reshape(hi - lo, *self.shapes[self.weight])
        if self.bias:
            out[self.bias] = g.sum(2).reshape(hi - lo, *self.shapes[self.bias])
        return out

    def _sweep_cheaper(self, vector_sets: Sequence[dict[str, Tensor]]) -> bool:
        """Whether materialising gᵢ once (which also gives the norms, the sums and the
        second moments) is cheaper than a product per vector: several positions, and either
        several vectors or norms that would need a materialising sweep anyway."""
        if self.T == 1 or self._fused is not None:
            return False
        vectors = sum(1 for vs in vector_sets if self.weight and self.weight in vs)
        return vectors > 1 or (vectors == 1 and not self._gram_cheaper())

    def _gram_cheaper(self) -> bool:
        # per sample and group: Gram costs T²(I+O) multiply-adds, materialising T·I·O
        return self.T * (self.I + self.O) < self.I * self.O

    def sq_norms(self) -> dict[str, Tensor]:
        if self._sq is not None:
            return self._sq
        if self._fused is not None or self._kept is not None:
            self._sq = self._fused_pass()[0]
        elif self.T == 1:
            x, g = self.patches(0, self.ctx.batch_size)
            gsq = g.square().sum(-1)[:, :, 0]  # (B, groups)
            self._sq = {}
            if self.weight:  # ‖g xᵀ‖² = ‖g‖²‖x‖²: O(B(I+O))
                self._sq[self.weight] = (gsq * x.square().sum(-1)[:, :, 0]).sum(1)
            if self.bias:
                self._sq[self.bias] = gsq.sum(1)
        elif self._gram_cheaper():
            # ‖Σₜ gₜxₜᵀ‖² = Σₜₛ (gₜ·gₛ)(xₜ·xₛ); chunks bounded to about the patches' size
            step = max(1, min(self.step, self.ctx.chunk_size * (self.I + self.O) // self.T))
            parts: dict[str, list[Tensor]] = {n: [] for n in (self.weight, self.bias) if n}
            for lo in range(0, self.ctx.batch_size, step):
                x, g = self.patches(lo, min(lo + step, self.ctx.batch_size))
                if self.weight:
                    gram = (g @ g.transpose(-1, -2)) * (x @ x.transpose(-1, -2))
                    parts[self.weight].append(gram.sum((1, 2, 3)))
                if self.bias:
                    parts[self.bias].append(g.sum(2).square().sum((1, 2)))
            self._sq = {n: torch.cat(p) for n, p in parts.items()}
        else:
            self._sq = self._fused_pass()[0]
        return self._sq

    def grad_sum(self, observed: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """Σᵢ gᵢ. The weight's is `observed` when Freivalds' check accepts it: one pass over
        the patches with a fixed random vector r instead of a (O, I)-sized product per
        sample position."""
        if self._sum is not None:
            return self._sum
        if self._fused is not None or self._kept is not None:
            self._sum = self._fused_pass()[1]
            return self._sum
        if self.weight_grads is not None:  # exact and as cheap as checking a candidate
            _, g = self.products(0, self.ctx.batch_size, [], False)
            sums = {self.bias: g.sum((0, 2))} if self.bias else {}
            if self.weight:
                sums[self.weight] = self.weight_grads(0, self.ctx.batch_size, False)
            self._sum = {n: s.reshape(self.shapes[n]) for n, s in sums.items()}
            return self._sum
        candidate = (observed or {}).get(self.weight) if self.weight else None
        sums = self._sums_and_check(candidate)
        if self.weight and self.weight not in sums:  # no candidate, or it failed the check
            sums = self._sums_and_check(None)
        self._sum = {n: s.reshape(self.shapes[n]) for n, s in sums.items()}
        return self._sum

    def _sums_and_check(self, candidate: Tensor | None) -> dict[str, Tensor]:
        """One pass over the patches for the sums: the bias's always; the weight's is
        `candidate` if it passes the check, absent if it fails, computed if there is none."""
        r = _probe(self.I, self.dtype, candidate.device) if candidate is not None else None
        sums: dict[str, Tensor] = {}
        for lo in range(0, self.ctx.batch_size, self.step):
            hi = min(lo + self.step, self.ctx.batch_size)
            part: dict[str, Tensor] = {}
            if r is not None:  # Σᵢ gᵢ r = Σ g (x·r), and its bound Σ |g| (|x|·|r|)
                probe = r.expand(self.groups, 1, self.I)
                (xr,), g = self.products(lo, hi, [probe], False)
                (xr_abs,), _ = self.products(lo, hi, [probe.abs()], True)
                part["u"] = torch.einsum("bgto,bgt->go", g, xr[..., 0])
                part["e"] = torch.einsum("bgto,bgt->go", g.abs(), xr_abs[..., 0])
            else:
                x, g = self.patches(lo, hi)
            if self.bias:
                part[self.bias] = g.sum((0, 2))
            if r is None and self.weight:
                part[self.weight] = self._weight_shaped(torch.einsum("bgto,bgti->goi", g, x))
            for n, s in part.items():
                sums[n] = sums[n] + s if n in sums else s
        if r is not None:
            u, e = sums.pop("u"), sums.pop("e")
            v = self._weight_goi(candidate) @ r
            # both sides round a chain of B·T + I products: |error| ≤ (B·T + I)·ε·e each
            eps = torch.finfo(self.dtype).eps
            chain = self.ctx.batch_size * self.T + self.I + 4
            if bool(((u - v).abs() <= 2 * chain * eps * e).all()):
                sums[self.weight] = candidate
        return sums

    def second_moments(self) -> dict[str, Tensor]:
        if self._m2 is not None:
            return self._m2
        if self.T == 1 and self._fused is None and self._kept is None:
            x, g = self.patches(0, self.ctx.batch_size)
            g2 = g[:, :, 0].square()
            self._m2 = {}
            if self.weight:  # Σᵢ (gᵢxᵢᵀ)² = Σᵢ gᵢ² (xᵢ²)ᵀ: one matmul of squares
                m2 = torch.einsum("bgo,bgi->goi", g2, x[:, :, 0].square())
                self._m2[self.weight] = self._weight_shaped(m2)
            if self.bias:
                self._m2[self.bias] = g2.sum(0).reshape(self.shapes[self.bias])
        else:
            self._m2 = self._fused_pass()[2]
        return self._m2

    def dots(self, vector_sets: Sequence[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
        if self._kept is not None or self._sweep_cheaper(vector_sets):
            return super().dots(vector_sets)
        groups, O = self.groups, self.O
        # gᵢ·V = Σₜ gₜᵀ V xₜ: one product per vector, every vector from the same patches
        ws = [self._weight_goi(vs[self.weight]) for vs in vector_sets
              if self.weight and self.weight in vs]
        bs = [vs[self.bias].reshape(groups, O) for vs in vector_sets
              if self.bias and self.bias in vs]
        parts: dict[str, list[Tensor]] = {}
        for lo in range(0, self.ctx.batch_size, self.step):
            through, g = self.products(lo, min(lo + self.step, self.ctx.batch_size), ws, False)
            if ws:
                dots = [(xw * g).sum((1, 2, 3)) for xw in through]
                parts.setdefault(self.weight, []).append(torch.stack(dots, 1))
            if bs:
                summed = g.sum(2)
                dots = [(summed * v).sum((1, 2)) for v in bs]
                parts.setdefault(self.bias, []).append(torch.stack(dots, 1))
        return split_dots({n: torch.cat(p) for n, p in parts.items()}, vector_sets)

    def parts(self) -> Iterator[dict[str, Part]]:
        if self.T != 1 or self.groups != 1:
            yield from self.chunks()
            return
        x, g = self.patches(0, self.ctx.batch_size)  # one position: gᵢ = gout ⊗ x
        out: dict[str, Part] = {}
        if self.weight:
            out[self.weight] = (RankOne(x[:, 0, 0], g[:, 0, 0]) if self.transposed
                                else RankOne(g[:, 0, 0], x[:, 0, 0]))
        if self.bias:
            out[self.bias] = g[:, 0, 0].reshape(-1, *self.shapes[self.bias])
        yield out


@functools.lru_cache(maxsize=32)
def _probe(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A fixed standard-normal vector of length n for Freivalds' check (fixed, so that
    results are reproducible)."""
    generator = torch.Generator().manual_seed(20240601)
    r = torch.randn(n, generator=generator, dtype=torch.float64)
    return r.to(device=device, dtype=dtype)


class LinearRule(Rule):
    """nn.Linear with inputs (B, …, in): sequence dims are summed per sample."""

    transposed = False  # the weight is (out, in)

    def _features(self) -> tuple[int, int]:
        """(in features, out features)."""
        return self.module.in_features, self.module.out_features

    def grads(self, calls: list[Call], ctx: Context) -> ModuleGrads:
        n_in, n_out = self._features()
        dtype = next(iter(self.params.values())).dtype
        xs, gs = [], []
        for call in calls:
            x = first_input(call)
            if x.dim() < 2:
                raise Unsupported("its input is 1-D; give it a batch dimension at dim 0")
            xs.append(x.to(dtype).reshape(x.shape[0], -1, n_in))
            gs.append(self._output_grad(call, dtype).reshape(x.shape[0], -1, n_out))
        # (B, 1 group, T, features); concatenating calls along T sums their contributions
        x_all = (xs[0] if len(xs) == 1 else torch.cat(xs, 1)).unsqueeze(1)
        g_all = (gs[0] if len(gs) == 1 else torch.cat(gs, 1)).unsqueeze(1)
        scale = ctx.scale
        # G scaled slice by slice, of at most a quarter of a materialised chunk (the sums'
        # check holds a few at once); a small G (an MLP's) is scaled once, for every pass
        once = g_all.numel() <= CHUNK_ELEMENTS // 16
        if once:
            g_all = g_all * scale
        return OuterProductGrads(
            (lambda lo, hi: (x_all[lo:hi], g_all[lo:hi])) if once
            else (lambda lo, hi: (x_all[lo:hi], g_all[lo:hi] * scale)),
            (1, x_all.shape[2], n_in, n_out),
            weight_and_bias(self.params),
            {n: p.shape for n, p in self.params.items()},
            dtype,
            ctx,
            step=samples_per_chunk(x_all.shape[0], 4 * x_all.shape[2] * n_out),
            transposed=self.transposed,
        )


class Conv1DRule(LinearRule):
    """Hugging Face's `Conv1D` (transformers.pytorch_utils, GPT-2's projections): a Linear
    layer whose weight is stored (in, out), y = x @ W + b."""

    transposed = True

    def _features(self) -> tuple[int, int]:
        return self.module.nx, self.module.nf


def weight_and_bias(params: dict) -> tuple[str | None, str | None]:
    """('weight' / None, 'bias' / None) by which of the two are trainable."""
    return ("weight" if "weight" in params else None, "bias" if "bias" in params else None)
