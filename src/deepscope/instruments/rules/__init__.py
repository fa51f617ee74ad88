"""Registry of per-sample gradient rules, by module type.

`rule_for(module)` picks the rule class for a module: its exact type first, then a rule
for a known type of another library (by its module path and name, so that the library is
never imported), then the first registered base class it derives from *without overriding
`forward`* (a subclass with its own forward computes something else), else the generic rule.
A module with parametrizations (torch.nn.utils.parametrize) gets `ParametrizedRule`: its
type's closed form would give gradients of the computed tensor, not of its parameters.
"""

from __future__ import annotations

from torch import nn
from torch.nn.utils import parametrize

from .base import Call, Context, ModuleGrads, Rule, Unsupported
from .conv import ConvRule
from .embedding import EmbeddingBagRule, EmbeddingRule
from .generic import GenericRule, MultiheadAttentionRule, ParametrizedRule, RNNRule
from .linear import Conv1DRule, LinearRule
from .norm import NormRule, rms_norm_type
from .recurrent import LSTMRule

_REGISTRY: dict[type[nn.Module], type[Rule]] = {
    nn.Linear: LinearRule,
    nn.Conv1d: ConvRule,
    nn.Conv2d: ConvRule,
    nn.Conv3d: ConvRule,
    nn.Embedding: EmbeddingRule,
    nn.EmbeddingBag: EmbeddingBagRule,
    nn.LayerNorm: NormRule,
    nn.GroupNorm: NormRule,
    nn.BatchNorm1d: NormRule,
    nn.BatchNorm2d: NormRule,
    nn.BatchNorm3d: NormRule,
    nn.SyncBatchNorm: NormRule,
    nn.MultiheadAttention: MultiheadAttentionRule,
    nn.RNN: RNNRule,
    nn.LSTM: LSTMRule,
    nn.GRU: RNNRule,
}
# (defining module, class name) -> rule, for other libraries' layers
_BY_NAME: dict[tuple[str, str], type[Rule]] = {
    ("transformers.pytorch_utils", "Conv1D"): Conv1DRule,
}
if rms_norm_type() is not None:
    _REGISTRY[rms_norm_type()] = NormRule


def register_rule(module_type: type[nn.Module], rule: type[Rule]) -> None:
    """Use `rule` for modules of `module_type` (and subclasses that keep its forward).

    E.g. `register_rule(MyBlock, GenericRule)`; a custom module that uses a child's
    parameters without calling the child needs a rule with `recursive = True`.
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"module_type must be an nn.Module subclass, got {module_type!r}")
    if not (isinstance(rule, type) and issubclass(rule, Rule)):
        raise TypeError(f"rule must be a Rule subclass (e.g. GenericRule), got {rule!r}")
    _REGISTRY[module_type] = rule


def rule_for(module: nn.Module) -> type[Rule]:
    """The rule class for `module` (see the module docstring for the order)."""
    if parametrize.is_parametrized(module):
        return ParametrizedRule
    return type_rule(module)


def type_rule(module: nn.Module) -> type[Rule]:
    """The rule class for `module`'s type, parametrizations aside."""
    kind = type(module)
    if kind in _REGISTRY:
        return _REGISTRY[kind]
    if (kind.__module__, kind.__name__) in _BY_NAME:
        return _BY_NAME[(kind.__module__, kind.__name__)]
    for base, rule in _REGISTRY.items():
        if isinstance(module, base) and kind.forward is base.forward:
            return rule
    return GenericRule


__all__ = [
    "Call",
    "Context",
    "Conv1DRule",
    "ConvRule",
    "EmbeddingBagRule",
    "EmbeddingRule",
    "GenericRule",
    "LSTMRule",
    "LinearRule",
    "ModuleGrads",
    "MultiheadAttentionRule",
    "NormRule",
    "ParametrizedRule",
    "RNNRule",
    "Rule",
    "Unsupported",
    "register_rule",
    "rule_for",
]
