"""The server's traced dense network computes what the module does, for every model kind and batch size; a
network whose trace would not generalize is served as it is."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from persia_core.config.model import ModelConfig
from persia_core.models import build_model
from persia_core.serve.server import traced_dense

SLOTS, DIM = 5, 8


def _holder(dense: torch.nn.Module, num_dense: int) -> SimpleNamespace:
    """What ``traced_dense`` reads of a ``LoadedModel``."""
    return SimpleNamespace(
        dense=dense,
        layouts=[SimpleNamespace(dim=DIM)],
        slots=[f"s{i}" for i in range(SLOTS)],
        manifest=SimpleNamespace(dense=[f"d{i}" for i in range(num_dense)]),
        model_dir="/models/m",
    )


@pytest.mark.parametrize(
    ("config", "num_dense"),
    [
        (ModelConfig(kind="dnn", hidden=[32, 16], bottom=[8]), 3),
        (ModelConfig(kind="dnn", hidden=[32]), 0),
        (ModelConfig(kind="dlrm", hidden=[32, 16], bottom=[16]), 4),
        (ModelConfig(kind="dcnv2", hidden=[32], cross_layers=2, structure="stacked"), 3),
        (ModelConfig(kind="dcnv2", hidden=[32], cross_layers=2, cross_rank=4, structure="parallel"), 3),
        (ModelConfig(kind="deepfm", hidden=[32, 16]), 3),
        (ModelConfig(kind="lr", hidden=[], wide=True), 3),
    ],
    ids=["dnn", "dnn-no-dense", "dlrm", "dcnv2-stacked", "dcnv2-parallel-low-rank", "deepfm", "lr"],
)
@pytest.mark.parametrize("optimize", [False, True], ids=["as-served", "profiling-executor"])
def test_the_traced_network_equals_the_module_at_every_batch_size(config, num_dense, optimize):
    torch.manual_seed(0)
    module = build_model(config, SLOTS, DIM, num_dense, [0.5] * num_dense, [2.0] * num_dense).eval()
    holder = _holder(module, num_dense)
    gen = torch.Generator().manual_seed(1)
    # serve runs the traces without the profiling executor's optimizations; both must compute the module's logits
    with torch.jit.optimized_execution(optimize), torch.no_grad():
        traced_dense(holder)  # type: ignore[arg-type]
        assert isinstance(holder.dense, torch.jit.ScriptModule)
        for b in (1, 2, 100, 1000):
            emb, dense = torch.randn(b, SLOTS, DIM, generator=gen), torch.randn(b, num_dense, generator=gen)
            got, want = holder.dense(emb, dense), module(emb, dense)
            assert got.shape == (b,)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


class _ByBatchSize(torch.nn.Module):
    """A network whose Python branch on the batch size a trace would fix at the size it was traced with."""

    def forward(self, emb: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        out = emb.sum(dim=(1, 2))
        return out * 2 if emb.shape[0] > 10 else out


def test_a_network_whose_trace_does_not_generalize_is_served_as_it_is(caplog):
    module = _ByBatchSize()
    holder = _holder(module, 2)
    with caplog.at_level(logging.WARNING, logger="persia.serve"):
        traced_dense(holder)  # type: ignore[arg-type]
    assert holder.dense is module
    assert "/models/m: serving the dense network untraced" in caplog.text
    assert "differs from it" in caplog.text
