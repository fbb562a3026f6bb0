"""Dense-side regularization: dropout in the MLPs (``model.dropout``) and decoupled weight decay
(``trainer.dense_weight_decay``), against plain recomputations."""

import math
import sys

import numpy as np
import pytest
import torch
from support import tiny_config, write_dataset
from torch.optim.optimizer import register_optimizer_step_pre_hook

from persia_core.config import ModelConfig, RunConfig, TrainerConfig, load_config
from persia_core.embedding.reference import LocalEmbedding
from persia_core.embedding.warm_start import warm_start_differences
from persia_core.models import build_model, decay_dense_lr, dense_optimizer, fused_step
from persia_core.train import worker
from persia_core.train.embedding_worker import StepRules

KINDS = ["dnn", "dlrm", "dcnv2", "deepfm"]


def _model(kind: str, dropout: float) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(kind=kind, hidden=[32, 16], bottom=[8], dropout=dropout), 3, 4, 2).double()


@pytest.mark.parametrize("kind", KINDS)
def test_dropout_changes_no_parameter_and_is_the_identity_in_eval_mode(kind):
    # the same state-dict keys with and without dropout (a model saved by either loads into the other, and warm
    # start does not see a changed model), and in eval mode the same function
    plain, dropped = _model(kind, 0.0), _model(kind, 0.5)
    assert list(plain.state_dict()) == list(dropped.state_dict())
    dropped.load_state_dict(plain.state_dict())
    emb, dense = torch.randn(6, 3, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    plain.eval(), dropped.eval()
    torch.testing.assert_close(dropped(emb, dense), plain(emb, dense), rtol=0, atol=0)
    dropped.train()
    assert not torch.equal(dropped(emb, dense), plain(emb, dense))


@pytest.mark.parametrize("kind", KINDS)
def test_training_mode_dropout_zeroes_hidden_units_at_the_rate_and_scales_the_rest_by_one_over_keep(kind):
    # inverted dropout after every hidden ReLU of the top/deep MLP: each unit is 0 or relu(x) / (1 - p)
    p = 0.3
    model = _model(kind, p).train()
    drops = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops and all(d.p == p for d in drops)
    assert len(drops) == 2  # one per hidden layer [32, 16], none in the bottom MLP or the cross layers
    seen = []

    def hook(module, args, out):
        seen.append((args[0].detach(), out.detach()))

    for d in drops:
        d.register_forward_hook(hook)
    model(torch.randn(4096, 3, 4, dtype=torch.float64), torch.randn(4096, 2, dtype=torch.float64))
    for x, y in seen:
        kept = y != 0
        torch.testing.assert_close(y[kept], x[kept] / (1 - p), rtol=1e-12, atol=0)
        live = x > 0
        rate = 1 - (kept & live).sum().item() / live.sum().item()
        assert abs(rate - p) < 0.02, rate


def test_a_change_of_dropout_is_no_warm_start_difference_even_from_a_model_saved_without_the_key():
    config = load_config("criteo")
    old = config.to_dict()
    del old["model"]["dropout"]
    dense = list(config.layout.dense_columns)
    assert warm_start_differences(old, dense, config.with_overrides({"model.dropout": 0.2}), dense) == []
    changed = config.with_overrides({"model.hidden": [64]})
    assert warm_start_differences(old, dense, changed, dense) == [f"model.hidden: {config.model.hidden!r} -> [64]"]


def test_model_dropout_and_dense_weight_decay_are_checked_naming_the_field():
    with pytest.raises(ValueError, match="model.dropout"):
        ModelConfig(dropout=1.0)
    with pytest.raises(ValueError, match="model.dropout"):
        ModelConfig(dropout=-0.1)
    with pytest.raises(ValueError, match="trainer.dense_weight_decay"):
        TrainerConfig(dense_weight_decay=-1.0)
    with pytest.raises(ValueError, match="trainer.dense_weight_decay"):
        TrainerConfig(dense_lr=0.1, dense_weight_decay=10.0)


def test_dense_weight_decay_is_adamw_on_weight_matrices_recomputed_in_float64():
    # Loshchilov & Hutter (ICLR 2019), Algorithm 2 with torch's placement of the decay before the Adam update:
    #   w <- w * (1 - lr * wd);  m, v <- Adam moments;  w <- w - lr * m_hat / (sqrt(v_hat) + eps)
    # on parameters of >= 2 dims; biases take the Adam update alone
    lr, wd, eps, b1, b2 = 0.01, 0.5, 1e-8, 0.9, 0.999
    model = _model("dnn", 0.0)
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    m = {n: torch.zeros_like(p) for n, p in ref.items()}
    v = {n: torch.zeros_like(p) for n, p in ref.items()}
    opt = dense_optimizer(model, lr, wd)
    torch.manual_seed(1)
    for t in range(1, 4):
        emb, dense = torch.randn(8, 3, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
        opt.zero_grad()
        model(emb, dense).pow(2).mean().backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        for n, g in grads.items():
            if ref[n].dim() >= 2:
                ref[n] = ref[n] * (1 - lr * wd)
            m[n] = b1 * m[n] + (1 - b1) * g
            v[n] = b2 * v[n] + (1 - b2) * g * g
            mh, vh = m[n] / (1 - b1**t), v[n] / (1 - b2**t)
            ref[n] = ref[n] - lr * mh / (vh.sqrt() + eps)
    decayed = 0
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref[n], rtol=1e-10, atol=1e-12)
        decayed += p.dim() >= 2
    assert decayed >= 3


def test_no_weight_decay_is_plain_adam_and_decay_covers_every_parameter_once():
    model = _model("dlrm", 0.0)
    assert type(dense_optimizer(model, 1e-3)) is torch.optim.Adam
    decayed = dense_optimizer(model, 1e-3, 0.1)
    assert type(decayed) is torch.optim.AdamW
    groups = [{id(p) for p in g["params"]} for g in decayed.param_groups]
    assert [g["weight_decay"] for g in decayed.param_groups] == [0.1, 0.0]
    assert groups[0].isdisjoint(groups[1])
    assert groups[0] | groups[1] == {id(p) for p in model.parameters()}
    assert all(p.dim() >= 2 for p in decayed.param_groups[0]["params"])


@pytest.mark.parametrize("kind", [*KINDS, "lr"])
def test_the_output_bias_shifts_every_logit_by_itself_and_starts_at_the_base_rate_log_odds(kind):
    # output_bias() is the logit's bias: adding delta to it adds exactly delta to every logit; build_model with a
    # base rate starts it at log(p / (1 - p)), and with bias_init: zero leaves the default initialization
    cfg = ModelConfig(kind=kind, hidden=[32, 16], bottom=[8], wide=kind == "lr")
    torch.manual_seed(0)
    model = build_model(cfg, 3, 4, 2, base_rate=0.2).double()
    assert model.output_bias().item() == pytest.approx(math.log(0.2 / 0.8), rel=1e-7)
    emb, dense = torch.randn(5, 3, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    before = model(emb, dense)
    with torch.no_grad():
        model.output_bias().add_(0.75)
    torch.testing.assert_close(model(emb, dense), before + 0.75, rtol=0, atol=1e-12)
    torch.manual_seed(0)
    zero = build_model(
        ModelConfig(kind=kind, hidden=[32, 16], bottom=[8], wide=kind == "lr", bias_init="zero"), 3, 4, 2, base_rate=0.2
    )
    torch.manual_seed(0)
    default = build_model(ModelConfig(kind=kind, hidden=[32, 16], bottom=[8], wide=kind == "lr"), 3, 4, 2)
    for a, b in zip(zero.state_dict().values(), default.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="model.bias_init"):
        ModelConfig(bias_init="mean")


@pytest.mark.parametrize("kind", ["dnn", "dlrm", "dcnv2"])
def test_model_wide_adds_a_zero_started_linear_dense_term_recomputed_in_float64(kind):
    # the wide part's linear term (Wide & Deep): logit(wide) = logit(no wide) + z @ w, z the standardized dense
    # features; it starts at 0 and is made without a random draw, so every other weight is the same as without it
    mean, std = [0.5, -1.0], [2.0, 0.25]

    def build(wide: bool):
        torch.manual_seed(0)
        cfg = ModelConfig(kind=kind, hidden=[32, 16], bottom=[8], wide=wide)
        return build_model(cfg, 3, 4, 2, mean, std).double()

    plain, wide = build(False), build(True)
    assert torch.equal(wide.wide_dense.weight, torch.zeros(1, 2, dtype=torch.float64))
    assert [p for p in wide.first_order_dense()] == [wide.wide_dense.weight]
    plain_sd = plain.state_dict()
    assert set(wide.state_dict()) - set(plain_sd) == {"wide_dense.weight"}
    for k, v in plain_sd.items():
        assert torch.equal(wide.state_dict()[k], v), k
    torch.manual_seed(2)
    emb, dense = torch.randn(6, 3, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    torch.testing.assert_close(wide(emb, dense), plain(emb, dense), rtol=0, atol=0)
    w = torch.tensor([[0.3, -1.7]], dtype=torch.float64)
    with torch.no_grad():
        wide.wide_dense.weight.copy_(w)
    z = (dense - torch.tensor(mean, dtype=torch.float64)) / torch.tensor(std, dtype=torch.float64)
    expected = plain(emb, dense) + (z * w).sum(1)
    torch.testing.assert_close(wide(emb, dense), expected, rtol=0, atol=1e-12)
    # no dense features: no term; LR and DeepFM keep their own linear term as the first-order one
    torch.manual_seed(0)
    assert build_model(ModelConfig(kind="dnn", hidden=[8], bottom=[], wide=True), 3, 4, 0).wide_dense is None
    for other in ("lr", "deepfm"):
        m = build_model(ModelConfig(kind=other, hidden=[8], bottom=[], wide=True), 3, 4, 2)
        assert m.wide_dense is None and m.first_order_dense() == [m.linear.weight]


def test_the_first_order_dense_term_takes_its_own_adam_rate_without_decay():
    # Adam's first step moves every weight of a nonzero gradient by its group's lr (m_hat / sqrt(v_hat) = sign(g));
    # the linear dense term's group has first_order_lr and no decay, whatever the others' decay
    torch.manual_seed(0)
    model = build_model(ModelConfig(kind="dlrm", hidden=[16], bottom=[8], wide=True), 3, 4, 2).double()
    lr, first_lr = 1e-3, 0.05
    opt = dense_optimizer(model, lr, 0.5, first_order_lr=first_lr)
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(lr, 0.5), (lr, 0.0), (first_lr, 0.0)]
    assert opt.param_groups[2]["params"] == [model.wide_dense.weight]
    ids = [{id(p) for p in g["params"]} for g in opt.param_groups]
    assert sum(len(s) for s in ids) == len(set().union(*ids)) == len(list(model.parameters()))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(1)
    emb, dense = torch.randn(8, 3, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    opt.zero_grad()
    model(emb, dense).sigmoid().mean().backward()
    grad = model.wide_dense.weight.grad.detach().clone()
    assert (grad != 0).all()
    opt.step()
    step = model.wide_dense.weight.detach() - before["wide_dense.weight"]
    torch.testing.assert_close(step, -first_lr * grad.sign(), rtol=1e-6, atol=0)
    bias = model.output_bias()
    name = next(n for n, p in model.named_parameters() if p is bias)
    assert abs(abs(float(bias.detach() - before[name])) - lr) < 1e-6 * lr
    # without first_order_lr (model.wide off, or no such term) it is the optimizer it was
    assert type(dense_optimizer(model, lr)) is torch.optim.Adam
    assert len(dense_optimizer(model, lr, 0.5).param_groups) == 2


def test_dense_weights_saved_without_the_wide_dense_term_load_with_it_at_zero(tmp_path):
    from persia_core.models import load_dense_weights

    torch.manual_seed(0)
    old = build_model(ModelConfig(kind="dcnv2", hidden=[16], bottom=[8], wide=False), 3, 4, 2)
    torch.manual_seed(5)
    new = build_model(ModelConfig(kind="dcnv2", hidden=[16], bottom=[8], wide=True), 3, 4, 2)
    load_dense_weights(new, old.state_dict(), "yesterday/dense.pt")
    assert torch.equal(new.wide_dense.weight, torch.zeros(1, 2))
    emb, dense = torch.randn(4, 3, 4), torch.randn(4, 2)
    torch.testing.assert_close(new(emb, dense), old(emb, dense), rtol=0, atol=0)
    # anything else that does not fit is refused, naming the file
    with pytest.raises(RuntimeError, match="yesterday/dense.pt.*do not fit"):
        load_dense_weights(old, new.state_dict(), "yesterday/dense.pt")
    bad = dict(old.state_dict())
    del bad["head.bias"]
    with pytest.raises(RuntimeError, match=r"(?s)yesterday/dense.pt.*Missing.*head.bias"):
        load_dense_weights(new, bad, "yesterday/dense.pt")


def test_wide_dense_lr_is_checked_naming_the_field():
    with pytest.raises(ValueError, match="trainer.wide_dense_lr"):
        TrainerConfig(wide_dense_lr=0.0)


def test_dense_lr_decay_scales_every_group_but_the_first_order_term_and_is_checked():
    # trainer.dense_lr_decay: at an epoch's end every group's rate is multiplied by it (weight-decayed or not),
    # the linear dense term's group (first_order_lr) keeps its own; with one group (plain Adam) that group decays
    torch.manual_seed(0)
    model = build_model(ModelConfig(kind="dlrm", hidden=[16], bottom=[8], wide=True), 3, 4, 2).double()
    opt = dense_optimizer(model, 1e-3, 0.5, first_order_lr=0.05)
    for _ in range(3):
        decay_dense_lr(opt, model, 0.5)
    assert [g["lr"] for g in opt.param_groups] == [1e-3 / 8, 1e-3 / 8, 0.05]
    plain = dense_optimizer(model, 1e-3)
    decay_dense_lr(plain, model, 0.25)
    assert [g["lr"] for g in plain.param_groups] == [2.5e-4]
    assert TrainerConfig().dense_lr_decay == 1.0
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=r"trainer.dense_lr_decay.*\(0, 1\]"):
            TrainerConfig(dense_lr_decay=bad)


def test_the_trainer_decays_the_deep_rate_at_each_epochs_end_and_trains_the_first_epoch_alike(tmp_path, monkeypatch):
    # an in-process K = 0 run of 3 epochs: the rates after each epoch's end are dense_lr * d^e (the linear dense
    # term's group keeps wide_dense_lr); the first epoch's losses are those of d = 1 bit for bit, the later differ
    data = write_dataset(str(tmp_path / "data"), rows=96)
    seen: list[list[float]] = []

    def spy(opt, model, factor):
        decay_dense_lr(opt, model, factor)
        seen.append([g["lr"] for g in opt.param_groups])

    monkeypatch.setattr(worker, "decay_dense_lr", spy)

    def run(decay: float) -> list[float]:
        d = tiny_config(epochs=3, dense_lr=0.01, wide_dense_lr=0.02, dense_lr_decay=decay).to_dict()
        d["model"]["wide"] = True
        cfg = RunConfig.from_dict(d)
        out = str(tmp_path / f"run-{decay}")
        backend = LocalEmbedding(cfg.embedding, num_shards=1, seed=0)
        return worker.run_worker(cfg, data, out, backend, rank=0, world=1)["loss"]

    plain, decayed = run(1.0), run(0.5)
    assert seen == [[0.01 * 0.5**e, 0.02] for e in (1, 2, 3)]
    per_epoch = len(plain) // 3
    assert len(plain) == len(decayed) == 3 * per_epoch > 0
    assert plain[:per_epoch] == decayed[:per_epoch]
    assert not np.allclose(plain[per_epoch:], decayed[per_epoch:], rtol=0, atol=1e-7)


def test_embedding_lr_decay_is_checked_naming_the_field():
    assert TrainerConfig().embedding_lr_decay == 1.0
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=r"trainer.embedding_lr_decay.*\(0, 1\]"):
            TrainerConfig(embedding_lr_decay=bad)


def test_the_embedding_rate_multiplier_counts_epochs_from_epoch0_and_stays_above_0():
    rules = StepRules(staleness=0, num_workers=1, rank=0, lr_decay=0.5, steps_per_epoch=4, epoch0=2)
    assert [rules.lr_scale(s) for s in (0, 3, 4, 9)] == [0.25, 0.25, 0.125, 0.0625]
    assert 0 < StepRules(0, 1, 0, lr_decay=0.01, steps_per_epoch=1).lr_scale(10_000) <= sys.float_info.min
    assert StepRules(0, 1, 0, lr_decay=0.5).lr_scale(10**6) == 1.0  # no epoch length: one epoch


def test_the_epochs_trained_that_ftrl_l2_grows_by_count_steps_from_epoch0():
    rules = StepRules(staleness=0, num_workers=1, rank=0, steps_per_epoch=4, epoch0=2)
    assert [rules.epochs_trained(s) for s in (0, 3, 4, 9)] == [2.25, 3.0, 3.25, 4.5]
    assert StepRules(0, 1, 0).epochs_trained(10**6) == 1.0  # no epoch length: one epoch


def _spy_pushes(monkeypatch, field: str = "lr_scale") -> list[tuple[str, int, float]]:
    """``(table, step, value of the keyword field)`` of every push an in-process run makes, in order (a field not
    passed: 1.0, the default of ``lr_scale`` and ``epochs_trained``)."""
    pushes: list[tuple[str, int, float]] = []
    real = LocalEmbedding.push

    def spy(self, table, ids, grads, *args, **kw):
        pushes.append((table, int(kw.get("step", args[0] if args else 0)), kw.get(field, 1.0)))
        return real(self, table, ids, grads, *args, **kw)

    monkeypatch.setattr(LocalEmbedding, "push", spy)
    return pushes


def test_the_embedding_tables_but_the_wide_one_step_at_their_epochs_decayed_rate(tmp_path, monkeypatch):
    # an in-process K = 0 run of 3 epochs with model.wide: every push of epoch e (from 0) carries lr_scale d^e, the
    # wide table's 1; the first epoch's losses are those of d = 1 bit for bit, the later differ
    data = write_dataset(str(tmp_path / "data"), rows=96)
    pushes = _spy_pushes(monkeypatch)

    def run(decay: float) -> list[float]:
        d = tiny_config(epochs=3, embedding_lr_decay=decay).to_dict()
        d["model"]["wide"] = True
        cfg = RunConfig.from_dict(d)
        backend = LocalEmbedding(cfg.embedding, num_shards=1, seed=0)
        pushes.clear()
        return worker.run_worker(cfg, data, str(tmp_path / f"run-{decay}"), backend, rank=0, world=1)["loss"]

    plain = run(1.0)
    assert {s for _, _, s in pushes} == {1.0}
    decayed = run(0.5)
    per_epoch = len(decayed) // 3
    assert per_epoch > 0 and {t for t, _, _ in pushes} == {"default", "wide"}
    for table, step, scale in pushes:
        assert scale == (1.0 if table == "wide" else 0.5 ** (step // per_epoch)), (table, step, scale)
    assert plain[:per_epoch] == decayed[:per_epoch]
    assert not np.allclose(plain[per_epoch:], decayed[per_epoch:], rtol=0, atol=1e-7)


def test_every_push_carries_the_epochs_trained_by_which_the_wide_tables_l2_grows(tmp_path, monkeypatch):
    # an in-process K = 0 run of 3 epochs with an FTRL wide table: push i of every table carries epochs_trained
    # (i + 1) / steps per epoch; with l2_per_epoch equal to l2 the first epoch's losses are those of l2 alone bit
    # for bit (max(l2, l2_per_epoch * e)), the later ones differ
    data = write_dataset(str(tmp_path / "data"), rows=96)
    seen = _spy_pushes(monkeypatch, "epochs_trained")

    def run(per_epoch: float) -> list[float]:
        d = tiny_config(epochs=3).to_dict()
        d["model"]["wide"] = True
        ftrl = {"name": "ftrl", "lr": 0.5, "eps": 1.0, "l2": 0.05, "l2_per_epoch": per_epoch}
        d["embedding"]["tables"].append({"name": "wide", "dim": 1, "init_scale": 0.0, "optimizer": ftrl})
        cfg = RunConfig.from_dict(d)
        backend = LocalEmbedding(cfg.embedding, num_shards=1, seed=0)
        seen.clear()
        return worker.run_worker(cfg, data, str(tmp_path / f"run-{per_epoch}"), backend, rank=0, world=1)["loss"]

    fixed = run(0.0)
    grown = run(0.05)
    steps = len(grown) // 3
    assert steps > 0 and {t for t, _, _ in seen} == {"default", "wide"}
    for table, step, epochs in seen:
        assert epochs == (step + 1) / steps, (table, step, epochs)
    assert fixed[:steps] == grown[:steps]
    assert not np.allclose(fixed[steps:], grown[steps:], rtol=0, atol=1e-7)


def test_the_pass_over_the_validation_slice_steps_at_the_rate_after_the_kept_epoch(tmp_path, monkeypatch):
    # epochs: auto, 3 epochs scored (patience 3, patience_z off: no early stop), no refit: the pass after the kept
    # epoch k trains its embedding tables at d^k, as the epoch after it would have
    data = write_dataset(str(tmp_path / "data"), rows=128)
    pushes = _spy_pushes(monkeypatch)
    cfg = tiny_config(epochs="auto", max_epochs=3, patience=3, patience_z=0.0, embedding_lr_decay=0.5)
    backend = LocalEmbedding(cfg.embedding, num_shards=cfg.embedding.num_shards, seed=0)
    hist = worker.run_worker(cfg, data, str(tmp_path / "run"), backend, rank=0, world=1)
    kept, steps = hist["best_epoch"], hist["validation_pass"]["steps"]
    assert 1 <= kept <= 3 and steps > 0
    per_epoch = (len(pushes) - steps) // 3
    assert [s for _, _, s in pushes[:-steps]] == [0.5 ** (i // per_epoch) for i in range(3 * per_epoch)]
    assert [(t, s) for t, _, s in pushes[-steps:]] == [("default", 0.5**kept)] * steps


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_nn_workers_fused_step_equals_the_optimizers_step_bit_for_bit(weight_decay):
    # fused_step (one kernel call per group, what an NN worker runs) against opt.step on a twin: Adam and AdamW with
    # their groups (decayed, not decayed, the first-order term at its own rate), a rate decayed mid-way, and a
    # parameter without a gradient on some steps (skipped by both); the first step creates the state via opt.step
    torch.manual_seed(0)
    models = [build_model(ModelConfig(kind="dlrm", hidden=[6], bottom=[5], wide=True), 3, 4, 2) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [dense_optimizer(m, 0.01, weight_decay, fused=True, first_order_lr=0.05) for m in models]
    assert len(opts[0].param_groups) >= 2
    for t in range(25):
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
            g = None if (t % 6 == 2 and a.dim() == 1) else torch.randn_like(a)
            a.grad, b.grad = g, None if g is None else g.clone()
        if t == 10:
            for o, m in zip(opts, models, strict=True):
                decay_dense_lr(o, m, 0.5)
        opts[0].step()
        fused_step(opts[1])
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)
        for key in opts[0].state[a]:
            assert torch.equal(opts[0].state[a][key], opts[1].state[b][key])
    # anything else is the optimizer's own step
    p = torch.nn.Parameter(torch.ones(3))
    sgd = torch.optim.SGD([p], lr=0.5)
    p.grad = torch.ones(3)
    fused_step(sgd)
    assert torch.equal(p.detach(), torch.full((3,), 0.5))
    # a step hook (here torch's global one) is the optimizer's own step's to run
    seen = []
    handle = register_optimizer_step_pre_hook(lambda o, a, k: seen.append(o))
    try:
        fused_step(opts[1])
    finally:
        handle.remove()
    assert seen == [opts[1]]
