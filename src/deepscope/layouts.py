"""Where the batch is in the activations of PyTorch's sequence modules (the recorder's
watched outputs; the instruments' per-sample gradients inside sequence-first transformers).

Every other module's output is batch-first (dim 0). The exceptions, by module:
  - nn.RNN / LSTM / GRU: the output (B, T, H) with batch_first, else (T, B, H); the states
    h_n / c_n (layers·directions, B, H) always; a PackedSequence's rows are time steps of
    several samples (no batch dim);
  - nn.MultiheadAttention: the attention output (B, L, E) with batch_first, else (L, B, E);
    the weights (B, [heads,] L, S) always;
  - nn.Transformer and its encoder / decoder (layers) with batch_first=False: (T, B, E), and
    so is every activation inside them (their Linear, LayerNorm and Dropout run on it).
Unbatched calls (2-D inputs) have no batch dim. A sequence-first computation of the user's
own (a Linear on an RNN's (T, B, H) output) is not known here: its batch dim stays 0.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.utils.rnn import PackedSequence

from .naming import named_leaves

_TRANSFORMERS = (nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder,
                 nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def _transformer_batch_first(module: nn.Module) -> bool:
    """batch_first of a PyTorch transformer module (its attention's, for the layers)."""
    if isinstance(module, nn.Transformer):
        return module.batch_first
    if isinstance(module, (nn.TransformerEncoder, nn.TransformerDecoder)):
        module = module.layers[0]
    return module.self_attn.batch_first


def sequence_first_modules(model: nn.Module) -> set[int]:
    """ids of the modules inside (or being) a PyTorch transformer with batch_first=False,
    whose 3-D activations are (T, B, …)."""
    inside: set[int] = set()
    for module in model.modules():
        if isinstance(module, _TRANSFORMERS) and not _transformer_batch_first(module):
            inside.update(id(m) for m in module.modules())
    return inside


def output_batch_dims(module: nn.Module, output: Any, sequence_first: bool
                      ) -> dict[str, int | None]:
    """{suffix (as `named_leaves`): batch dim} of the output leaves whose batch is not dim 0;
    `sequence_first`: the module is in `sequence_first_modules`."""
    leaves = named_leaves(output)
    if isinstance(module, nn.RNNBase) and isinstance(output, tuple) and len(output) == 2:
        out = output[0]
        packed = isinstance(out, PackedSequence)
        if not packed and out.dim() != 3:  # unbatched
            return {suffix: None for suffix, _ in leaves}
        first = None if packed else 0 if module.batch_first else 1
        # the states (layers·directions, B, H) whatever batch_first is
        return {suffix: first if suffix.startswith(".0") else 1 for suffix, _ in leaves}
    if isinstance(module, nn.MultiheadAttention) and isinstance(output, tuple):
        if output[0].dim() != 3:
            return {suffix: None for suffix, _ in leaves}
        return {".0": 0 if module.batch_first else 1}  # the weights are batch-first
    if sequence_first:
        return {suffix: 1 if t.dim() == 3 else None for suffix, t in leaves}
    return {}
