"""DCNv2 and DeepFM against float64 recomputations of their formulas, and the shipped DCNv2 configs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from persia_core.bench.criteo_synth import write_criteo_synth
from persia_core.config import ModelConfig, load_config
from persia_core.models import DCNv2, DeepFM, build_model


@pytest.mark.parametrize("rank", [0, 3])
def test_a_dcnv2_cross_layer_is_x0_times_w_xl_plus_b_plus_xl_in_float64(rank):
    # Wang et al., WWW 2021, Eq. 1 (rank 0: full-rank W) and Eq. 2 with one expert (W = U V)
    torch.manual_seed(0)
    B, S, D, F = 4, 3, 2, 2
    model = DCNv2(S, D, F, hidden=[], bottom=[], cross_layers=2, cross_rank=rank).double()
    emb = torch.randn(B, S, D, dtype=torch.float64)
    dense = torch.randn(B, F, dtype=torch.float64)
    x0 = np.concatenate([emb.flatten(1).numpy(), model.normalize(dense).numpy()], 1)
    x = x0
    for layer in model.cross:
        if rank:
            w = layer.u.weight.detach().numpy() @ layer.v.weight.detach().numpy()
            b = layer.u.bias.detach().numpy()
        else:
            w, b = layer.w.weight.detach().numpy(), layer.w.bias.detach().numpy()
        assert w.shape == (S * D + F, S * D + F)
        x = x0 * (x @ w.T + b) + x
    want = x @ model.head.weight.detach().numpy()[0] + model.head.bias.detach().numpy()[0]
    np.testing.assert_allclose(model(emb, dense).detach().numpy(), want, rtol=1e-12)


def test_dcnv2_parallel_concatenates_the_cross_output_with_the_mlp_on_x0():
    torch.manual_seed(1)
    B, S, D, F = 5, 2, 3, 1
    model = DCNv2(S, D, F, hidden=[4], bottom=[], cross_layers=1, structure="parallel").double()
    emb, dense = torch.randn(B, S, D, dtype=torch.float64), torch.randn(B, F, dtype=torch.float64)
    x0 = torch.cat([emb.flatten(1), model.normalize(dense)], 1)
    cross = model.cross[0](x0, x0)
    deep = torch.relu(model.deep[0](x0))
    want = model.head(torch.cat([cross, deep], 1)).squeeze(1)
    torch.testing.assert_close(model(emb, dense), want, rtol=1e-12, atol=1e-12)


def test_the_deepfm_interaction_is_the_sum_of_pairwise_dot_products_of_the_slots():
    # Guo et al., IJCAI 2017, Sec. 2.1 (the FM component), Rendle 2010 Eq. 5; compared with a double loop
    torch.manual_seed(2)
    B, S, D, F = 4, 5, 3, 2
    model = DeepFM(S, D, F, hidden=[6], bottom=[]).double()
    emb, dense = torch.randn(B, S, D, dtype=torch.float64), torch.randn(B, F, dtype=torch.float64)
    e = emb.numpy()
    fm = np.array([sum(e[b, i] @ e[b, j] for i, j in itertools.combinations(range(S), 2)) for b in range(B)])
    z = model.normalize(dense)
    deep = model.deep(torch.cat([emb.flatten(1), z], 1)).squeeze(1).detach().numpy()
    linear = model.linear(z).squeeze(1).detach().numpy()
    np.testing.assert_allclose(model(emb, dense).detach().numpy(), fm + linear + deep, rtol=1e-12)


def test_model_config_refuses_an_unknown_kind_or_structure_naming_the_field():
    with pytest.raises(ValueError, match="'model.kind'.*'dcnv2'"):
        ModelConfig(kind="dcn")
    with pytest.raises(ValueError, match="'model.structure'"):
        ModelConfig(kind="dcnv2", structure="sideways")


@pytest.fixture(scope="module")
def tiny_criteo(tmp_path_factory):
    data = str(tmp_path_factory.mktemp("criteo"))
    write_criteo_synth(data, train_rows=64, eval_rows=16, vocab=50)
    return data


@pytest.mark.parametrize("name", ["dcnv2", "dcnv2_mlperf"])
def test_the_shipped_dcnv2_configs_build_and_train_one_step_on_tiny_data(name, tmp_path, tiny_criteo):
    from persia_core.embedding.reference import LocalEmbedding
    from persia_core.train.worker import run_worker

    cfg = load_config(name)
    data = tiny_criteo
    cfg = cfg.with_overrides({"trainer.batch_size": 64, "trainer.num_workers": 1, "trainer.epochs": 1})
    model = build_model(cfg.model, len(cfg.slots), cfg.embedding.tables[0].dim, 13)
    assert isinstance(model, DCNv2) and len(model.cross) == cfg.model.cross_layers
    if name == "dcnv2_mlperf":  # MLPerf's DLRM-DCNv2 shape
        assert cfg.embedding.tables[0].dim == 128 and cfg.model.cross_layers == 3
        assert cfg.model.hidden == [1024, 1024, 512, 256]
    backend = LocalEmbedding(cfg.embedding, num_shards=1, seed=0)
    hist = run_worker(cfg, data, str(tmp_path / "out"), backend, rank=0, world=1)
    assert len(hist["loss"]) == 1 and np.isfinite(hist["loss"][0])
    dense = torch.load(tmp_path / "out" / "dense.pt", weights_only=True)
    assert any(k.startswith("cross.") for k in dense)


def test_a_model_that_cannot_be_built_on_the_data_is_refused_before_training_naming_the_field():
    from support import tiny_config

    from persia_core.train.launcher import check_config_matches_data

    with pytest.raises(ValueError, match=r"'model.cross_rank': 432 is not below the cross layers' width 432"):
        ModelConfig(kind="dcnv2", cross_rank=432, bottom=[16]).check_fits(26, 16, 13)
    ModelConfig(kind="dcnv2", cross_rank=431, bottom=[16]).check_fits(26, 16, 13)
    cfg = tiny_config().with_overrides({"model.kind": "dlrm"})
    schema = {"rows": {"train": 10}, "slots": ["a", "b", "tags"], "dense": []}
    with pytest.raises(ValueError, match=r"'model.kind': dlrm needs dense features"):  # before: after start-up
        check_config_matches_data(cfg, schema, "data")
