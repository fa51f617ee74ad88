"""`ComgraRecorder`: comgra's recording calls mapped onto a deepscope `Scope`.

The run is written to `comgra_root_path/group/trial_id` as a normal deepscope run, so
`deepscope serve comgra_root_path/group` shows it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...recorder.schedule import Schedule
from ...recorder.scope import Scope
from ...recorder.step import StepRecorder
from ...store.layout import rank_files

log = logging.getLogger("deepscope")
_UNDECIDED = "__undecided__"  # kind of a step whose type is decided at its end


class ComgraRecorder:
    """comgra's recorder. Unknown comgra keyword arguments are accepted and ignored."""

    def __init__(self, comgra_root_path: str | Path, group: str, trial_id: str,
                 decision_maker_for_recordings: Schedule | None = None,
                 comgra_is_active: bool = True, max_num_batch_size_to_record: int | None = None,
                 calculate_svd_and_other_expensive_operations_of_parameters: bool = False,
                 **_: Any) -> None:
        self.active = comgra_is_active
        self._scope: Scope | None = None
        self._rec: StepRecorder | None = None
        self._iteration: Any = None
        self._pending_notes: list[str] = []
        if not comgra_is_active:
            return
        project = Path(comgra_root_path) / group
        if rank_files(project / trial_id):
            # comgra replaces a trial silently; we replace it too, but say so.
            log.warning("deepscope: replacing existing run %s (comgra semantics)",
                        project / trial_id)
        decide = decision_maker_for_recordings or (lambda step, kind: True)
        self._scope = Scope(
            project, trial_id, overwrite=True, anomalies=False,
            schedule=lambda step, kind: kind != _UNDECIDED and bool(decide(step, kind)),
            dynamic=lambda step, kind: kind == _UNDECIDED,
            max_samples=max_num_batch_size_to_record if max_num_batch_size_to_record else 4,
            singular_values=calculate_svd_and_other_expensive_operations_of_parameters)
        self._decide = decide

    @property
    def scope(self) -> Scope | None:
        """The deepscope scope underneath (None when comgra_is_active=False)."""
        return self._scope

    def track_module(self, module_name: str, module: nn.Module) -> None:
        if self._scope is not None:
            self._scope.watch(module, name=module_name)

    def add_note(self, note: Any) -> None:
        if self._scope is not None:
            self._scope.note(str(note))

    def start_batch(self, training_step: int, current_batch_size: int | None = None,
                    type_of_execution: str | None = "main_execution_type", **_: Any) -> None:
        """Open a training step; type_of_execution=None decides recording at its end."""
        if self._scope is None:
            return
        kind = _UNDECIDED if type_of_execution is None else type_of_execution
        self._rec = self._scope.begin_step(training_step, kind=kind)

    def decide_recording_of_batch(self, type_of_execution: str, **_: Any) -> bool:
        """For start_batch(type_of_execution=None): set the type and decide now."""
        rec = self._require("decide_recording_of_batch")
        if rec is None:
            return False
        rec.kind = type_of_execution
        keep = bool(self._decide(rec.step, type_of_execution))
        rec.keep() if keep else rec.discard()
        return keep

    def start_iteration(self, **_: Any) -> None:
        rec = self._require("start_iteration")
        if rec is not None:
            self._iteration = rec.iteration()
            self._iteration.__enter__()

    def register_tensor(self, tensor_name: str, tensor: torch.Tensor,
                        index_of_batch_dimension: int | None = 0, is_input: bool = False,
                        is_parameter: bool = False, is_output: bool = False,
                        is_target: bool = False, is_loss: bool = False,
                        node_name: str | None = None, role_within_node: str | None = None,
                        **_: Any) -> None:
        rec = self._require("register_tensor")
        if rec is None:
            return
        role = ("input" if is_input else "parameter" if is_parameter else "output" if is_output
                else "target" if is_target else "loss" if is_loss else "activation")
        batch_dim = None if (is_parameter or tensor.dim() == 0) else index_of_batch_dimension
        rec.tensor(tensor_name, tensor, role=role, node=node_name,
                   role_in_node=role_within_node, batch_dim=batch_dim)

    def add_tensor_connection(self, src: str, dst: str) -> None:
        rec = self._require("add_tensor_connection")
        if rec is not None:
            rec.connect(src, dst)

    def record_kpi_in_graph(self, kpi_group: str, kpi_name: str, val: Any, **_: Any) -> None:
        rec = self._require("record_kpi_in_graph")
        if rec is not None:
            rec.kpi("/".join(p for p in (kpi_group, kpi_name) if p) or "kpi", val)

    def record_current_gradients(self, name: str, **_: Any) -> None:
        rec = self._require("record_current_gradients")
        if rec is not None:
            rec.gradients(name)

    def finish_iteration(self, **_: Any) -> None:
        if self._iteration is not None:
            self._iteration.__exit__(None, None, None)
            self._iteration = None

    def finish_batch(self, **_: Any) -> None:
        if self._rec is not None:
            self._rec = None
            self._scope.end_step()

    def finalize(self) -> None:
        self.finish_batch()
        if self._scope is not None:
            self._scope.close()

    def _require(self, call: str) -> StepRecorder | None:
        if self._scope is None:
            return None
        if self._rec is None:
            raise ValueError(f"{call}(...) called outside a batch; call start_batch(...) first")
        return self._rec
