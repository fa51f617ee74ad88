"""HessMaxEV's cadence in the full configuration: computed at the first step its schedule
picks and at every k-th one after, absent (not stale, not approximate) at the others; each
computed value is that step's top eigenvalue of the dense float64 Hessian."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian

import deepscope
from deepscope.catalogue import CONFIGURATIONS, MAX_EV_EVERY
from deepscope.instruments.quantities.curvature import MAX_EV_TOL

F64 = torch.float64


def _dense_top(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The mean loss's largest Hessian eigenvalue, by torch.func and eigh (float64)."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def flat_loss(flat: torch.Tensor) -> torch.Tensor:
        parts = flat.split([p.numel() for p in params.values()])
        shaped = {n: t.view(params[n].shape) for n, t in zip(params, parts)}
        return nn.functional.cross_entropy(functional_call(model, shaped, (x,)), y)

    flat = torch.cat([p.reshape(-1) for p in params.values()])
    return float(torch.linalg.eigvalsh(hessian(flat_loss)(flat))[-1])


def _train(path, steps: int, schedule, **options) -> tuple[deepscope.Run, dict[int, float]]:
    """SGD steps of a float64 MLP with the full instruments; returns the run and each
    step's dense top eigenvalue (at the step's parameters)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(1)
    tops = {}
    # lanczos_iter > D: every value converges, so each can be checked to the tolerance
    options = {"curvature": "exact", "lanczos_iter": 90, **options}
    with deepscope.Scope(path, "run", schedule=deepscope.never, instruments="full",
                         instrument_schedule=schedule, anomalies=False,
                         instrument_options=options) as scope:
        scope.watch(model, optimizer=opt)
        for step in range(steps):
            x = torch.randn(16, 6, generator=gen, dtype=F64)
            y = torch.randint(0, 3, (16,), generator=gen)
            tops[step] = _dense_top(model, x, y)
            with scope.step(step) as rec:
                losses = nn.functional.cross_entropy(model(x), y, reduction="none")
                loss = losses.mean()
                rec.loss(loss, per_sample=losses)
                opt.zero_grad()
                loss.backward()
                opt.step()
    return deepscope.open_run(path / "run"), tops


def _steps_with(run: deepscope.Run, name: str) -> list[int]:
    q = run.quantities()
    return sorted(set(q[(q["name"] == name) & (q["layer"] == "")]["step"]))


@pytest.mark.parametrize(("schedule", "options", "computed", "every"), [
    # full's default cadence on every step: steps 0, k, 2k, ...
    (deepscope.every(1), {}, [0, 4, 8], 4),
    # every k-th step the schedule picks: 0, 2, 4, ... of every(2) with k = 3 -> 0, 6
    (deepscope.every(2), {"max_ev_every": 3}, [0, 6], 3),
    # restored: every step
    (deepscope.every(1), {"max_ev_every": 1}, list(range(10)), None),
])
def test_hess_max_ev_is_computed_on_its_cadence_and_exact_there(
        tmp_path, schedule, options, computed: list[int], every: int | None) -> None:
    assert MAX_EV_EVERY["full"] == 4
    run, tops = _train(tmp_path, 10, schedule, **options)
    picked = [s for s in range(10) if schedule(s, "default")]
    assert _steps_with(run, "HessMaxEV") == computed
    for name in CONFIGURATIONS["full"] - {"HessMaxEV", "Alpha"}:  # the others: every step
        assert _steps_with(run, name) == picked, name
    q = run.quantities()
    for step in computed:
        row = q[(q["name"] == "HessMaxEV") & (q["step"] == step)].iloc[0]
        assert row.meta["converged"], row.meta
        assert row.meta.get("every") == every
        assert row.value == pytest.approx(tops[step], rel=MAX_EV_TOL)


def test_a_list_of_names_computes_hess_max_ev_at_every_step(tmp_path) -> None:
    inst = deepscope.instruments.Instruments(nn.Linear(3, 2), ["HessMaxEV", "Loss"])
    assert inst.max_ev_every == 1
    assert deepscope.instruments.Instruments(nn.Linear(3, 2), "Full").max_ev_every == 4


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_bad_cadence_is_refused_in_one_line(bad) -> None:
    with pytest.raises(ValueError, match=r"^max_ev_every must be an int >= 1, got "):
        deepscope.instruments.Instruments(nn.Linear(3, 2), "full", max_ev_every=bad)
