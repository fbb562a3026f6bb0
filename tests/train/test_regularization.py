"""Dense-side regularization: dropout in the MLPs (``model.dropout``) and decoupled weight decay
(``trainer.dense_weight_decay``), against plain recomputations."""

import math

import pytest
import torch

from persia_core.config import ModelConfig, TrainerConfig, load_config
from persia_core.embedding.warm_start import warm_start_differences
from persia_core.models import build_model, dense_optimizer

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
