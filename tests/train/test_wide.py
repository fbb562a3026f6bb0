"""The wide (first-order) table of ``model.wide``: its config, its share of a shard's memory, training through
parameter servers and embedding workers against a plain PyTorch logistic regression, and its fit against
scikit-learn's on the same one-hot features."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support import tiny_config, write_dataset

from persia_core.config import WIDE_TABLE, RunConfig
from persia_core.data.reader import ParquetExamples, shard_files
from persia_core.embedding.shard_tables import load_shard_file, make_tables
from persia_core.evaluate.run import LoadedModel, score
from persia_core.memory import capacity_for_budget
from persia_core.train.launcher import train
from persia_core.train.schedule import make_schedule
from persia_core.train.worker import build_dense


def _wide_config(kind: str = "lr", optimizer: str = "adagrad", lr: float = 0.1, **trainer) -> RunConfig:
    d = tiny_config(**trainer).to_dict()
    d["model"].update(kind=kind, wide=True)
    d["embedding"]["tables"][0]["optimizer"] = {"name": optimizer, "lr": lr}
    return RunConfig.from_dict(d)


def test_model_wide_adds_a_dim_1_table_starting_at_zero_and_the_name_is_reserved():
    cfg = _wide_config(kind="dnn", optimizer="rowwise_adagrad", lr=0.07)
    wide = cfg.embedding.table(WIDE_TABLE)
    assert (wide.dim, wide.init_scale, wide.optimizer.name, wide.optimizer.lr) == (1, 0.0, "adagrad", 0.07)
    assert cfg.table_slots(WIDE_TABLE) == ["a", "b", "tags"] and cfg.table_slots("default") == ["a", "b", "tags"]
    again = RunConfig.from_dict(cfg.to_dict())  # a saved config holds the table: not added twice
    assert [t.name for t in again.embedding.tables] == ["default", WIDE_TABLE]

    def refused(edit, match):
        d = tiny_config().to_dict()
        edit(d)
        with pytest.raises(ValueError, match=match):
            RunConfig.from_dict(d)

    refused(lambda d: d["embedding"]["tables"].append({"name": "wide", "dim": 1}), r"tables\[wide\].*model.wide")
    refused(lambda d: d["model"].update(kind="lr"), r"model.wide.*set wide: true")

    def declared_dim_2(d):
        d["model"]["wide"] = True
        d["embedding"]["tables"].append({"name": "wide", "dim": 2})

    refused(declared_dim_2, r"tables\[wide\]\.dim.*dim 1, got 2")

    def slot_names_it(d):
        d["model"]["wide"] = True
        d["embedding"]["tables"].append({"name": "wide", "dim": 1})
        d["slots"][0]["table"] = "wide"

    refused(slot_names_it, r"slots\[a\]\.table.*wide table")


def test_overrides_of_the_first_table_reach_an_implied_wide_table_and_wide_can_be_turned_off():
    # the wide table a config implies (not declared) follows the first table's optimizer through --set-style
    # overrides, however many are applied; turning model.wide off drops it; one declared or addressed is kept
    cfg = _wide_config(kind="dnn", optimizer="adagrad", lr=0.07)
    lr = cfg.with_overrides({"trainer.seed": 1}).with_overrides({"embedding.tables[0].optimizer.lr": 0.2})
    assert lr.embedding.table(WIDE_TABLE).optimizer.lr == 0.2
    wd = cfg.with_overrides({"embedding.tables.default.optimizer.weight_decay": 0.01})
    assert wd.embedding.table(WIDE_TABLE).optimizer.weight_decay == 0.01
    off = cfg.with_overrides({"model.wide": False})
    assert [t.name for t in off.embedding.tables] == ["default"]
    own = cfg.with_overrides({"embedding.tables.wide.optimizer.lr": 0.5})
    assert own.embedding.table(WIDE_TABLE).optimizer.lr == 0.5
    first_lr = {"embedding.tables[0].optimizer.lr": 0.2}
    assert own.with_overrides(first_lr).embedding.table(WIDE_TABLE).optimizer.lr == 0.5
    declared = RunConfig.from_dict(cfg.to_dict())  # a saved config declares it: it keeps its own settings
    assert declared.with_overrides(first_lr).embedding.table(WIDE_TABLE).optimizer.lr == 0.07


def test_the_wide_table_gets_a_share_of_the_shard_holding_as_many_rows_as_the_deep_table():
    cfg = _wide_config(kind="dnn", optimizer="rowwise_adagrad").with_overrides(
        {"embedding.shard_memory_bytes": 1 << 26}
    )
    emb = cfg.embedding
    budgets = emb.table_budgets()
    assert sum(budgets.values()) == emb.shard_memory_bytes
    deep, wide = emb.table("default"), emb.table(WIDE_TABLE)
    deep_rows = capacity_for_budget(budgets["default"], deep.optimizer.name, deep.dim)
    wide_rows = capacity_for_budget(budgets[WIDE_TABLE], wide.optimizer.name, wide.dim)
    assert abs(wide_rows - deep_rows) / deep_rows < 0.1, (deep_rows, wide_rows)
    tables = make_tables(emb.tables, emb.shard_memory_bytes)
    assert tables["default"].capacity == deep_rows and tables[WIDE_TABLE].capacity == wide_rows
    # without a wide table the budget is split evenly, as before
    plain = tiny_config().with_overrides({"embedding.shard_memory_bytes": 1 << 26}).embedding
    assert plain.table_budgets() == {"default": 1 << 26}


def _plain_torch_lr(cfg: RunConfig, data: str, steps_rows: list[np.ndarray], global_batch: list[int]):
    """The reference: the same dense LR part (same seed, its bias at the log-odds of the train labels' mean),
    every feature ID's weight a float64 zero-started entry of one tensor, ``torch.optim.Adagrad`` on those, Adam
    on the dense part (its linear term at ``wide_dense_lr``); the loss of each step as the trainer scales it."""
    examples = ParquetExamples(shard_files(data, "train"), cfg.slot_names)
    schema = json.load(open(f"{data}/schema.json"))
    dense = build_dense(cfg, schema, float(examples.labels.astype(np.float64).mean())).double()
    linear = [dense.linear.weight]  # the linear dense term: Adam at wide_dense_lr, the bias at dense_lr
    rest = [p for p in dense.parameters() if p is not dense.linear.weight]
    opt = torch.optim.Adam(
        [{"params": rest}, {"params": linear, "lr": cfg.trainer.wide_dense_lr}], lr=cfg.trainer.dense_lr
    )
    all_ids = np.unique(examples.batch(np.arange(len(examples))).ids.values)
    w = torch.zeros(len(all_ids), dtype=torch.float64, requires_grad=True)
    table_opt = cfg.embedding.table(WIDE_TABLE).optimizer
    assert table_opt.name == "adagrad"
    wide_opt = torch.optim.Adagrad([w], lr=table_opt.lr, eps=table_opt.eps)
    losses = []
    for rows, gb in zip(steps_rows, global_batch, strict=True):
        batch = examples.batch(rows)
        b, ids = batch.size, batch.ids
        sample = np.repeat(np.tile(np.arange(b), len(ids.keys)), ids.lengths)  # the sample of each ID
        idx = torch.from_numpy(np.searchsorted(all_ids, ids.values))
        wide = torch.zeros(b, dtype=torch.float64).index_add(0, torch.from_numpy(sample), w[idx])
        emb = torch.zeros(b, len(ids.keys), 4, dtype=torch.float64)
        logits = dense(emb, torch.from_numpy(batch.dense).double()) + wide
        loss_sum = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(batch.labels).double(), reduction="sum")
        opt.zero_grad()
        w.grad = None
        (loss_sum / gb).backward()
        opt.step()
        wide_opt.step()
        losses.append(float(loss_sum.detach()) / b)
    return losses, dense, dict(zip(all_ids.tolist(), w.detach().numpy().tolist(), strict=True))


@pytest.fixture(scope="module")
def lr_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("wide")
    data = write_dataset(str(root / "data"), rows=1024, eval_rows=2048, seed=3)
    cfg = _wide_config(
        lr=0.3, batch_size=256, epochs=100, dense_lr=0.05, wide_dense_lr=0.02, embedding_workers=2, shuffle=True
    )
    model = str(root / "model")
    manifest = train(cfg, data, model, work_dir=str(root / "work"))
    return {"root": root, "data": data, "cfg": cfg, "model": model, "manifest": manifest}


@pytest.mark.processes
def test_a_wide_lr_through_two_servers_and_two_embedding_workers_equals_a_plain_torch_logistic_regression(lr_run):
    cfg, data, model = lr_run["cfg"], lr_run["data"], lr_run["model"]
    tc = cfg.trainer
    n = len(ParquetExamples(shard_files(data, "train"), cfg.slot_names))
    sched = make_schedule([n], tc.batch_size, tc.epochs, tc.seed, tc.shuffle)
    losses, dense, weights = _plain_torch_lr(cfg, data, sched.rows[0], sched.global_batch)
    hist = json.load(open(f"{model}/train_metrics.json"))
    np.testing.assert_allclose(hist["loss"], losses, atol=1e-5, rtol=0)
    got = torch.load(f"{model}/dense.pt", weights_only=True)
    for k, v in dense.state_dict().items():
        np.testing.assert_allclose(got[k].numpy(), v.numpy(), atol=1e-5)
    held = {}
    for rel in lr_run["manifest"]["shard_files"]:
        tables = make_tables(cfg.embedding.tables, cfg.embedding.shard_memory_bytes)
        load_shard_file(f"{model}/{rel}", tables)
        sd = tables[WIDE_TABLE].state_dict()
        held.update(zip(sd["keys"].tolist(), sd["weights"][:, 0].tolist(), strict=True))
    assert set(held) == set(weights)
    keys = sorted(weights)
    np.testing.assert_allclose([held[k] for k in keys], [weights[k] for k in keys], atol=1e-5)
    assert max(abs(v) for v in weights.values()) > 0.1  # the weights moved


@pytest.mark.processes
def test_the_wide_lr_model_scores_as_scikit_learns_logistic_regression_on_the_same_one_hot_features(lr_run):
    from scipy.sparse import csr_matrix, hstack
    from sklearn.feature_extraction import FeatureHasher
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score

    cfg, data = lr_run["cfg"], lr_run["data"]
    loaded = LoadedModel(lr_run["model"])

    def features(split: str):
        ex = ParquetExamples(shard_files(data, split), cfg.slot_names)
        batch = ex.batch(np.arange(len(ex)))
        ids, b = batch.ids, batch.size
        per_row = [[] for _ in range(b)]
        sample = np.repeat(np.tile(np.arange(b), len(ids.keys)), ids.lengths)
        for i, v in zip(sample.tolist(), ids.values.tolist(), strict=True):
            per_row[i].append(str(v))
        onehot = FeatureHasher(n_features=1 << 20, input_type="string", alternate_sign=False).transform(per_row)
        return ex, hstack([onehot, csr_matrix(batch.dense.astype(np.float64))]).tocsr(), batch.labels

    train_ex, x_train, y_train = features("train")
    eval_ex, x_eval, y_eval = features("eval")
    sk = LogisticRegression(C=1e4, max_iter=5000).fit(x_train, y_train)
    sk_auc = roc_auc_score(y_eval, sk.predict_proba(x_eval)[:, 1])
    ours = roc_auc_score(y_eval, score(loaded, eval_ex, batch_size=512))
    assert abs(ours - sk_auc) < 1e-3, (ours, sk_auc)
    assert ours > 0.7  # the planted model's signal was learnt
