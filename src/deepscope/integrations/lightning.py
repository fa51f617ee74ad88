"""Lightning (`lightning.pytorch`) callback: `Trainer(callbacks=[DeepscopeCallback(...)])`.

For the older `pytorch_lightning` namespace use `deepscope.integrations.pytorch_lightning`.
"""

from __future__ import annotations

from . import INTERRUPTED, require
from ._lightning_hooks import PER_SAMPLE_KEY, LightningHooks

_pl = require("lightning.pytorch", "lightning")

__all__ = ["INTERRUPTED", "PER_SAMPLE_KEY", "DeepscopeCallback"]


class DeepscopeCallback(LightningHooks, _pl.Callback):
    __doc__ = LightningHooks.__doc__
