"""Matrix-free Hessian of a scalar loss with respect to a list of parameter tensors.

The operator is built *before* the user's own ``loss.backward()``: it takes the gradient
with ``create_graph=True, retain_graph=True`` so the user's graph survives, and each
Hessian-vector product is one more backward pass through that gradient (reverse over
reverse). Estimators (Lanczos, Hutchinson, ...) only see ``matvec``/``matmat``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from itertools import accumulate

import torch
from torch import Tensor

MAX_BATCH_SIZE = 64  # HVPs per vmapped backward pass, for small models
BLOCK_ELEMENTS = 2**24  # flat elements per block (64 MiB in float32): caps batch for big D


class _NoSecondDerivative(NotImplementedError):
    """An op in the loss's graph has no double backward (e.g. CPU flash attention)."""


class HessianOperator:
    """The Hessian H = ∇²_θ loss as a linear map on flat parameter vectors.

    Flat vectors have shape (D,), D = total number of parameter elements, laid out as the
    parameters' ``reshape(-1)`` concatenated in the order given. They live on the loss's
    device and in the loss's dtype; each segment is cast to its parameter's dtype and
    device only inside the backward pass.

    Attributes:
        params: the parameter tensors, in order.
        dim:    D, the number of parameter elements.
        sizes:  elements per parameter tensor, in order (sum is D).
        shapes: the parameter tensors' shapes.
        dtype:  dtype of flat vectors (the loss's).
        device: device of flat vectors (the loss's).
        batch_size: HVPs per vmapped backward pass in `matmat`; by default 64, fewer when
                D is large so that a block holds at most 2**24 elements.
        batched: vmapped HVPs verified (True), unusable (False) or unchecked (None); the
                constructor takes an earlier operator's verdict for the same model.

    Call `release` (or use ``with HessianOperator(...) as op:``) to free the
    double-backward graph; the user's graph is never freed by this class.
    """

    def __init__(
        self,
        loss: Tensor,
        params: Sequence[Tensor],
        batch_size: int | None = None,
        *,
        batched: bool | None = None,
    ) -> None:
        if not isinstance(loss, Tensor):
            raise TypeError(f"loss must be a torch.Tensor, got {type(loss).__name__}")
        if loss.numel() != 1:
            raise ValueError(
                f"loss must be a scalar tensor, got shape {tuple(loss.shape)}; "
                "pass the reduced loss (e.g. losses.mean()), not per-sample losses"
            )
        if not loss.is_floating_point():
            raise TypeError(f"loss must be a floating-point tensor, got dtype {loss.dtype}")
        if not loss.requires_grad:
            raise ValueError(
                "loss does not require grad; compute it with grad enabled from parameters "
                "that require grad (not under torch.no_grad())"
            )
        if isinstance(params, Tensor) or not isinstance(params, Sequence):
            raise TypeError(
                "params must be a list of tensors, e.g. list(model.parameters()), "
                f"got {type(params).__name__}"
            )
        self.params: list[Tensor] = list(params)
        if not self.params:
            raise ValueError("params is empty; pass the tensors to differentiate by")
        seen: set[int] = set()
        for i, p in enumerate(self.params):
            if not isinstance(p, Tensor):
                raise TypeError(f"params[{i}] must be a torch.Tensor, got {type(p).__name__}")
            if not p.requires_grad:
                raise ValueError(
                    f"params[{i}] (shape {tuple(p.shape)}) does not require grad; pass only "
                    "trainable parameters, e.g. [p for p in model.parameters() if p.requires_grad]"
                )
            if id(p) in seen:
                raise ValueError(f"params[{i}] appears twice in params; pass each tensor once")
            seen.add(id(p))
        if batch_size is not None:
            check_int("batch_size", batch_size, 1)

        self.sizes: list[int] = [p.numel() for p in self.params]
        self.shapes: list[torch.Size] = [p.shape for p in self.params]
        self.dim: int = sum(self.sizes)
        if self.dim == 0:
            raise ValueError("params hold no elements; pass non-empty parameter tensors")
        self.dtype: torch.dtype = loss.dtype
        self.device: torch.device = loss.device
        self.batch_size: int = hvp_batch_size(self.dim) if batch_size is None else batch_size
        # vmapped HVPs: unchecked / verified / unusable; a verdict from an earlier operator
        # of the same model saves the checking HVP (see `matmat`)
        self._batched: bool | None = batched

        # enable_grad: the recorder may build the operator inside a no_grad block.
        with torch.enable_grad():
            try:
                grads = torch.autograd.grad(
                    loss.reshape(()),
                    self.params,
                    create_graph=True,
                    retain_graph=True,
                    allow_unused=True,
                )
            except RuntimeError as err:
                if "second time" in str(err):
                    raise ValueError(
                        "loss's graph was already freed by backward(); build the "
                        "HessianOperator before calling loss.backward()"
                    ) from None
                raise
        # Gradient parts that do not depend on the parameters (unused parameters, or
        # a loss linear in them) have zero Hessian rows; only the others are differentiated.
        # nn.Embedding(sparse=True) gives a sparse gradient: densified, still differentiable
        self._grads: list[tuple[int, Tensor]] | None = [
            (i, g if g.layout == torch.strided else g.to_dense())
            for i, g in enumerate(grads) if g is not None and g.requires_grad
        ]
        # Parameters autograd.grad does not reach from the loss: unused, or reached only by a
        # backward pass of its own that autograd.grad cannot run (torch.utils.checkpoint with
        # use_reentrant=True); a caller tells them apart by whether .grad gets a gradient.
        self.unreached: list[int] = [i for i, g in enumerate(grads) if g is None]

    @property
    def batched(self) -> bool | None:
        """Whether vmapped HVPs were verified (True), found unusable (False), or not tried
        yet (None); pass it as ``batched=`` to the next operator of the same model."""
        return self._batched

    def __enter__(self) -> HessianOperator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Drop the create_graph gradient so its double-backward graph can be freed."""
        self._grads = None

    def split(self, flat: Tensor) -> list[Tensor]:
        """Views of a flat (D,) tensor shaped like each parameter, in order."""
        self._check_flat(flat, "flat", batched=False)
        return [seg.view(shape) for seg, shape in zip(flat.split(self.sizes), self.shapes)]

    def matvec(self, v: Tensor, out: Tensor | None = None) -> Tensor:
        """H v for a flat (D,) vector; returns a detached flat (D,) tensor: `out` when given
        (a (D,) tensor of the operator's dtype and device; a buffer reused across calls
        spares a fresh allocation per product, which page-faults on the CPU)."""
        self._check_flat(v, "v", batched=False)
        if out is not None:
            self._check_flat(out, "out", batched=False)
            out = out.unsqueeze(0)
        return self._hvp(v.unsqueeze(0), batched=False, out=out)[0]

    def matmat(self, V: Tensor) -> Tensor:
        """H applied to each row of V, shape (k, D) -> (k, D), detached.

        Rows go through one vmapped backward pass per `batch_size` rows
        (``is_grads_batched``). vmap batching rules can be missing (an error) or wrong
        (silently, e.g. pytorch/functorch#534), so the first batched block is checked
        against one plain backward pass of the sum of its rows; on an error or a mismatch
        the operator falls back to one backward pass per row from then on.
        """
        self._check_flat(V, "V", batched=True)
        # one output, filled in place: no fresh (D,)-sized pieces to concatenate
        out = torch.empty(V.shape, dtype=self.dtype, device=self.device)
        for lo in range(0, V.shape[0], self.batch_size):
            self._hvp_block(V[lo:lo + self.batch_size], out[lo:lo + self.batch_size])
        return out

    def _hvp_block(self, block: Tensor, out: Tensor) -> None:
        if self._batched is not False and block.shape[0] > 1:
            try:
                self._hvp(block, batched=True, out=out)
            except _NoSecondDerivative:
                raise
            except RuntimeError:  # an op without a vmap batching rule
                self._batched = False
            else:
                if self._batched or self._agrees_with_plain_backward(block, out):
                    self._batched = True
                    return
                self._batched = False
        for i, row in enumerate(block):
            self._hvp(row.unsqueeze(0), batched=False, out=out[i:i + 1])

    def _agrees_with_plain_backward(self, block: Tensor, out: Tensor) -> bool:
        """Whether H (Σ rows of block), one plain backward, equals the sum of out's rows."""
        plain = self._hvp(block.sum(0, keepdim=True), batched=False)[0]
        # Batched and plain differ only by round-off, relative to the rows summed.
        tol = torch.finfo(self.dtype).eps ** 0.5 * (plain.norm() + out.norm())
        return bool((out.sum(0) - plain).norm() <= tol)

    def _hvp(self, V: Tensor, batched: bool, out: Tensor | None = None) -> Tensor:
        """(k, D) -> (k, D), written into `out` if given; k must be 1 when not batched."""
        if self._grads is None:
            raise RuntimeError("HessianOperator was released; build a new one from a fresh loss")
        k = V.shape[0]
        if out is None:
            out = torch.empty(k, self.dim, dtype=self.dtype, device=self.device)
        if not self._grads:
            return out.zero_()  # loss is at most linear in the parameters: H = 0
        offsets = [0, *accumulate(self.sizes)]
        outputs, grad_outputs = [], []
        for i, g in self._grads:
            seg = V[:, offsets[i] : offsets[i + 1]].to(dtype=g.dtype, device=g.device)
            outputs.append(g)
            grad_outputs.append(seg.reshape(k, *g.shape) if batched else seg.reshape(g.shape))
        try:
            hv = torch.autograd.grad(
                outputs,
                self.params,
                grad_outputs=grad_outputs,
                retain_graph=True,
                allow_unused=True,
                is_grads_batched=batched,
            )
        except RuntimeError as err:
            message = str(err).splitlines()[0] if str(err) else ""
            if message.startswith("derivative for") and "not implemented" in message:
                raise _NoSecondDerivative(
                    f"the loss's graph has an op without a second derivative ({message}); "
                    "curvature needs twice-differentiable ops, e.g. run attention under "
                    "torch.nn.attention.sdpa_kernel(SDPBackend.MATH)"
                ) from None
            raise
        for i, h in enumerate(hv):
            part = out[:, offsets[i] : offsets[i + 1]]
            if h is None:
                part.zero_()  # a parameter the gradient does not depend on
            else:
                part.copy_((h if h.layout == torch.strided else h.to_dense()).reshape(k, -1))
        return out

    def _check_flat(self, x: Tensor, name: str, batched: bool) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        want = "(k, D)" if batched else "(D,)"
        ok = x.ndim == 2 and x.shape[1] == self.dim if batched else x.shape == (self.dim,)
        if not ok:
            raise ValueError(
                f"{name} must have shape {want} with D={self.dim}, got {tuple(x.shape)}; "
                "flatten with torch.cat([t.reshape(-1) for t in tensors])"
            )


def hvp_batch_size(dim: int) -> int:
    """HVPs per vmapped backward pass by default for D = `dim` parameter elements."""
    # The vmapped backward's memory grows with the batch too, so big models go row by row.
    return max(1, min(MAX_BATCH_SIZE, BLOCK_ELEMENTS // dim))


def check_operator(op: object) -> HessianOperator:
    """Return ``op`` if it is a HessianOperator, else raise a one-line TypeError."""
    if not isinstance(op, HessianOperator):
        raise TypeError(
            f"op must be a HessianOperator, got {type(op).__name__}; "
            "build one with HessianOperator(loss, list(model.parameters()))"
        )
    return op


def check_int(name: str, value: object, minimum: int) -> int:
    """Return ``value`` if it is an int >= ``minimum``, else raise a one-line error."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def seeded_generator(op: HessianOperator, seed: int) -> torch.Generator:
    """A torch.Generator on the operator's device, seeded for reproducible probes."""
    check_int("seed", seed, 0)
    return torch.Generator(device=op.device).manual_seed(seed)


def rademacher(op: HessianOperator, k: int, generator: torch.Generator) -> Tensor:
    """k Rademacher (±1) probe vectors, shape (k, D), in the operator's dtype/device.

    Each row is drawn by its own call, so the i-th probe from a generator is the same
    whether the probes come k at a time or one by one: batched and looped HVPs see the
    same probes, and give the same estimates."""
    # eight signs per random byte: drawing the random numbers is the cost (bernoulli_ was
    # several times slower for the same distribution); bit j of a byte gives sign j, looked
    # up as ±1 in one gather instead of shifting, masking and scaling (k, D) tensors
    per_row = (op.dim + 7) // 8
    random = torch.stack([torch.randint(0, 256, (per_row,), generator=generator,
                                        dtype=torch.uint8, device=op.device)
                          for _ in range(k)])
    signs = _byte_signs(op.dtype, op.device).index_select(0, random.reshape(-1).long())
    return signs.reshape(k, 8 * per_row)[:, :op.dim]


@functools.lru_cache(maxsize=8)
def _byte_signs(dtype: torch.dtype, device: torch.device) -> Tensor:
    """(256, 8): row b holds 2·bit_j(b) − 1 for j = 0..7."""
    bits = (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1
    return (2 * bits - 1).to(dtype)
