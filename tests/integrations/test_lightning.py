"""Lightning callback: the same numbers as a hand-written deepscope loop, and a readable run
marked interrupted when training raises."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import deepscope

STEPS, BATCH, CLIP = 6, 4, 0.6
ACCUMULATION = [1, 2]  # micro-batches per optimizer step (accumulate_grad_batches)
SCOPE = dict(schedule=3, instruments="economy", instrument_schedule=1)


@pytest.fixture(scope="module")
def pl():
    return pytest.importorskip("lightning.pytorch")


@pytest.fixture(scope="module")
def module_class(pl):
    class Tiny(pl.LightningModule):
        def __init__(self, fail_at: int | None = None) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(),
                                           torch.nn.Linear(8, 3))
            self.fail_at = fail_at

        def losses(self, batch):
            x, y = batch
            logits = self.net(x)
            acc = (logits.argmax(1) == y).float().mean()
            return F.cross_entropy(logits, y, reduction="none"), acc

        def training_step(self, batch, batch_idx):
            if batch_idx == self.fail_at:
                raise RuntimeError("boom in training_step")
            losses, acc = self.losses(batch)
            self.log("train_acc", acc)
            return {"loss": losses.mean(), "per_sample_loss": losses}

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
    return Tiny


def _data(k: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    n = STEPS * k * BATCH
    x, y = torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def _fit(pl, module, tmp_path, run: str, k: int) -> None:
    from deepscope.integrations.lightning import DeepscopeCallback
    trainer = pl.Trainer(max_steps=STEPS, accumulate_grad_batches=k, gradient_clip_val=CLIP,
                         accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path,
                         callbacks=[DeepscopeCallback(tmp_path, run, **SCOPE)])
    trainer.fit(module, _data(k))


def _hand_loop(module, tmp_path, run: str, k: int) -> None:
    opt = module.configure_optimizers()
    batches = iter(_data(k))
    with deepscope.Scope(tmp_path, run, **SCOPE) as scope:
        scope.watch(module, optimizer=opt)
        for step in range(STEPS):
            with scope.step(step) as rec:
                opt.zero_grad()
                for _ in range(k):
                    losses, acc = module.losses(next(batches))
                    loss = losses.mean() / k
                    rec.loss(loss, per_sample=losses)
                    loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
                rec.kpi("train_acc", acc)
                rec.kpi("grad_norm", norm)
                opt.step()


@pytest.mark.parametrize("k", ACCUMULATION)
def test_callback_equals_hand_written_loop(pl, module_class, tmp_path, k):
    torch.manual_seed(0)
    _fit(pl, module_class(), tmp_path, "lightning", k)
    torch.manual_seed(0)
    _hand_loop(module_class(), tmp_path, "hand", k)

    with deepscope.open_run(tmp_path / "lightning") as a, \
            deepscope.open_run(tmp_path / "hand") as b:
        qa, qb = a.quantities(), b.quantities()
        assert len(qa) == len(qb) and qa["value"].notna().sum() > 50
        assert set(qa["name"]) >= {"Alpha", "GradNorm", "NormTest", "UpdateSize", "Distance"}
        assert qa[["step", "name", "layer"]].equals(qb[["step", "name", "layer"]])
        np.testing.assert_allclose(qa["value"], qb["value"], rtol=1e-6, equal_nan=True)
        assert a.steps() == b.steps() == [0, 3]  # schedule=3: tensors recorded too
        ka, kb = a.kpis(), b.kpis()
        for name in ("loss", "train_acc", "grad_norm"):
            va, vb = ka[ka.name == name], kb[kb.name == name]
            assert va.step.tolist() == list(range(STEPS)), name
            np.testing.assert_allclose(va.value, vb.value, rtol=1e-6, err_msg=name)
        pre = ka[ka.name == "grad_norm"].value.to_numpy()
        clipped = ka[ka.name == "grad_norm_clipped"].value.to_numpy()
        assert (pre > CLIP).any()  # the test clips for real
        np.testing.assert_allclose(clipped, np.minimum(pre, CLIP), rtol=1e-5)


def test_exception_leaves_a_readable_run_marked_interrupted(pl, module_class, tmp_path):
    from deepscope.integrations.lightning import INTERRUPTED
    with pytest.raises(RuntimeError, match="boom"):
        _fit(pl, module_class(fail_at=3), tmp_path, "crash", 1)
    with deepscope.open_run(tmp_path / "crash") as run:
        notes = run.notes().text.tolist()
        assert notes == [f"{INTERRUPTED}: RuntimeError: boom in training_step"]
        assert run.status() == notes[0]
        assert run.kpis("loss").step.tolist() == [0, 1, 2]
        assert sorted(set(run.quantities("GradNorm").step)) == [0, 1, 2]
        assert run.steps() == [0]


def test_missing_per_sample_loss_is_one_line_naming_the_key(pl, module_class, tmp_path):
    class PlainLoss(module_class):
        def training_step(self, batch, batch_idx):
            return self.losses(batch)[0].mean()
    with pytest.raises(ValueError, match="'per_sample_loss': losses"):
        _fit(pl, PlainLoss(), tmp_path, "plain", 1)
    with deepscope.open_run(tmp_path / "plain") as run:  # still closed and readable
        assert run.notes().text.str.startswith("interrupted: ValueError").all()


def test_pytorch_lightning_namespace(tmp_path):
    pl_old = pytest.importorskip("pytorch_lightning")
    from deepscope.integrations.pytorch_lightning import DeepscopeCallback

    class Old(pl_old.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(5, 3)

        def training_step(self, batch, batch_idx):
            losses = F.cross_entropy(self.net(batch[0]), batch[1], reduction="none")
            return {"loss": losses.mean(), "per_sample_loss": losses}

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl_old.Trainer(max_steps=2, accelerator="cpu", logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=tmp_path,
                             callbacks=[DeepscopeCallback(tmp_path, "old", schedule=1,
                                                          instruments=["GradNorm"])])
    trainer.fit(Old(), _data(1))
    with deepscope.open_run(tmp_path / "old") as run:
        assert run.steps() == [0, 1]
        assert run.quantities("GradNorm", layer="").value.notna().all()


@pytest.mark.browser
def test_lightning_run_opens_in_the_gui(pl, module_class, tmp_path, browser):
    from tests.gui.conftest import start_server
    from tests.gui.test_browser import node_names, open_graph
    torch.manual_seed(0)
    _fit(pl, module_class(), tmp_path, "lightning", 1)
    url, server = start_server(tmp_path)
    context, page = open_graph(browser, url)
    try:
        assert {"net.0", "net.2", "loss"} <= set(node_names(page))
    finally:
        context.close()
        server.shutdown()
        server.server_close()
