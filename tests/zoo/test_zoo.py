"""The model zoo: networks people train, each trained for a few steps with every module's
output recorded and the "full" instruments, then checked three ways: the graph of one block
is exact; every value is there or missing with a reason (the ones rightly missing are
listed per model); per-sample quantities equal a float64 per-sample loop.
"""

from __future__ import annotations

import pytest
import torch

from . import models as M
from .harness import ZooRun, block_edges, check_numbers, missing_values, train_case

# PyTorch's CPU attention kernels have no second derivative: curvature is refused, loudly.
NO_DOUBLE_BACKWARD = {q: "without a second derivative"
                      for q in ("HessTrace", "TICDiag", "HessMaxEV")}

CASES = {c.name: c for c in [
    M.ZooCase("resnet", M.ResNet, M._image_batch, M._classify, "layer1.1", M.RESNET_BLOCK,
              train_steps=1),
    M.ZooCase("gpt2", M._gpt2, M._lm_batch, M._gpt2_losses, "transformer.h.0", M.GPT2_BLOCK,
              train_steps=1, missing=NO_DOUBLE_BACKWARD),
    M.ZooCase("bert", M._bert, M._bert_batch, M._bert_losses, "bert.encoder.layer.0",
              M.BERT_BLOCK, train_steps=1, missing=NO_DOUBLE_BACKWARD),
    M.ZooCase("lstm", M.LSTMLM, M._lm_batch, M._token_losses, "lstm", M.LSTM_BLOCK),
    M.ZooCase("encoder", M.Encoder, M._bert_batch, M._encoder_losses, "encoder.layers.0",
              M.ENCODER_BLOCK, train_steps=1, missing=NO_DOUBLE_BACKWARD),
    # its convs' biases sit right before train-mode BatchNorms: their batch gradient cancels
    # (~1e-17), and the gradient tests, which divide by it, are missing for those layers
    M.ZooCase("cnn_bn_dropout", M._cnn, M._image_batch, M._classify, "", M.CNN_GRAPH,
              train_steps=1, missing={t: "round-off" for t in
                                      ("NormTest", "InnerTest", "OrthoTest")}),
    # bfloat16 keeps 8 significant bits: its per-sample gradients differ from float64's
    # by a few 1e-3, so this case alone is checked at 5e-2.
    M.ZooCase("bf16", M._mlp, M._vector_batch, M._classify, "", M.MLP_GRAPH,
              autocast=torch.bfloat16, rtol=5e-2),
    # Lanczos needs the whole step's loss graph at once; each micro-batch's backward frees it.
    M.ZooCase("accumulate2", M._mlp, M._vector_batch, M._classify, "", M.MLP_GRAPH,
              micro_batches=2, missing={"HessMaxEV": "gradient accumulation"}),
    M.ZooCase("accumulate4", M._mlp, M._vector_batch, M._classify, "", M.MLP_GRAPH,
              micro_batches=4, missing={"HessMaxEV": "gradient accumulation"}),
    M.ZooCase("frozen", M._frozen, M._sequence_batch, M._sequence_losses, "",
              M.FROZEN_GRAPH, frozen=("0",)),
    M.ZooCase("compiled", M._mlp, M._vector_batch, M._classify, "", M.MLP_GRAPH,
              compiled=True),
]}

_RUNS: dict[str, ZooRun | Exception] = {}


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: these models are tiny, and on a busy machine a second thread spins
    waiting for a core (the zoo ran 6x slower with two threads under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def zoo(tmp_path_factory):
    """Train a case once for all three checks (a failed training fails each of them)."""
    def get(name: str) -> ZooRun:
        if name not in _RUNS:
            try:
                _RUNS[name] = train_case(CASES[name], tmp_path_factory.mktemp(name))
            except Exception as exc:  # noqa: BLE001 - re-raised by every check of the case
                _RUNS[name] = exc
        got = _RUNS[name]
        if isinstance(got, Exception):
            raise got
        return got
    return get


@pytest.mark.parametrize("name", CASES)
def test_graph_of_one_block_exact(zoo, name):
    zr = zoo(name)
    for micro_batch in range(CASES[name].micro_batches):
        assert block_edges(zr, micro_batch) == CASES[name].block_edges, micro_batch


@pytest.mark.parametrize("name", CASES)
def test_every_value_present_or_missing_with_its_reason(zoo, name):
    missing = missing_values(zoo(name))
    expected = CASES[name].missing
    assert set(missing) == set(expected), missing
    for quantity, reasons in missing.items():
        assert all(expected[quantity] in r for r in reasons), (quantity, reasons)


@pytest.mark.parametrize("name", CASES)
def test_per_sample_quantities_equal_float64_loop(zoo, name):
    check_numbers(zoo(name))
