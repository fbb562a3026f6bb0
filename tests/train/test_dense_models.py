"""The dense models against plain recomputations."""

import numpy as np
import pytest
import torch

import persia_core.embedding.kernels as kernels
from persia_core.embedding.kernels import row_dots, row_dots_backward
from persia_core.models.dense import DLRM, DNN, grad_into


def test_dlrm_interaction_is_the_upper_triangle_of_pairwise_dots_and_its_gradient_matches():
    # DLRM (arXiv:1906.00091, Sec. 2): the top MLP sees [bottom(dense), <v_i, v_j> for i < j] over the S + 1
    # vectors (bottom output first, then the S embeddings); compared with a float64 double loop
    torch.manual_seed(0)
    B, S, D, F = 5, 4, 3, 2
    model = DLRM(S, D, F, hidden=[7], bottom=[6]).double()
    emb = torch.randn(B, S, D, dtype=torch.float64, requires_grad=True)
    dense = torch.randn(B, F, dtype=torch.float64)
    seen = {}
    model.top.register_forward_pre_hook(lambda m, args: seen.update(x=args[0].detach()))
    out = model(emb, dense)
    x = model.bottom(model.normalize(dense)).detach()
    v = torch.cat([x.unsqueeze(1), emb.detach()], 1).numpy()
    dots = [[v[b, i] @ v[b, j] for i in range(S + 1) for j in range(i + 1, S + 1)] for b in range(B)]
    np.testing.assert_allclose(seen["x"].numpy(), np.concatenate([x.numpy(), np.array(dots)], 1), rtol=1e-12)
    # the gradient through the interaction equals the one through two-index advanced indexing
    w = torch.randn(B, dtype=torch.float64)
    (g,) = torch.autograd.grad((out * w).sum(), emb)
    iu = torch.triu_indices(S + 1, S + 1, offset=1)

    def reference(e):
        xb = model.bottom(model.normalize(dense))
        t = torch.cat([xb.unsqueeze(1), e], 1)
        z = torch.bmm(t, t.transpose(1, 2))[:, iu[0], iu[1]]
        return model.top(torch.cat([xb, z], 1)).squeeze(1)

    e2 = emb.detach().clone().requires_grad_(True)
    (g_ref,) = torch.autograd.grad((reference(e2) * w).sum(), e2)
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)


def test_dnn_equals_its_top_mlp_on_the_concat_of_embeddings_and_bottom_output_with_the_same_gradients():
    # DNN computes its top MLP's first layer as two column blocks (no concat copy); compared in float64 with the
    # top MLP applied to the explicit concat(flatten(emb), bottom(normalize(dense)))
    torch.manual_seed(0)
    B, S, D, F = 6, 3, 4, 2
    for hidden, bottom in (([], []), ([5], [3])):
        model = DNN(S, D, F, hidden=hidden, bottom=bottom, dense_mean=[0.5, -1.0], dense_std=[2.0, 0.5]).double()
        emb = torch.randn(B, S, D, dtype=torch.float64, requires_grad=True)
        dense = torch.randn(B, F, dtype=torch.float64)
        w = torch.randn(B, dtype=torch.float64)
        (model(emb, dense) * w).sum().backward()
        got = [emb.grad.clone()] + [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        emb2 = emb.detach().clone().requires_grad_(True)
        ref = model.top(torch.cat([emb2.flatten(1), model.bottom(model.normalize(dense))], 1)).squeeze(1)
        np.testing.assert_allclose(model(emb.detach(), dense).detach().numpy(), ref.detach().numpy(), rtol=1e-12)
        (ref * w).sum().backward()
        want = [emb2.grad] + [p.grad for p in model.parameters()]
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10, atol=1e-12)


def test_dnn_writes_the_embedding_gradient_into_the_offered_memory_even_the_input_own():
    # grad_into(emb, emb): the NN worker's ring slot holds emb and takes d loss / d emb back. The weight gradient
    # must be read from emb before the input gradient overwrites it; every gradient equals plain autograd's (float64)
    # and emb.grad is the offered memory itself (no copy left to the NN worker)
    torch.manual_seed(1)
    B, S, D, F = 7, 3, 4, 2
    for hidden, bottom in (([], []), ([5], [3])):
        model = DNN(S, D, F, hidden=hidden, bottom=bottom).double()
        values = torch.randn(B, S, D, dtype=torch.float64)
        dense = torch.randn(B, F, dtype=torch.float64)
        w = torch.randn(B, dtype=torch.float64)
        ref_emb = values.clone().requires_grad_(True)
        (model(ref_emb, dense) * w).sum().backward()
        want = [ref_emb.grad.clone()] + [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        slot = values.clone()
        emb = grad_into(slot.requires_grad_(True), slot)
        np.testing.assert_allclose(model(emb, dense).detach().numpy(), model(values, dense).detach().numpy())
        (model(emb, dense) * w).sum().backward()
        assert emb.grad.data_ptr() == slot.data_ptr()
        got = [emb.grad] + [p.grad for p in model.parameters()]
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-12)


def test_a_one_output_first_layer_in_float32_runs_the_row_dot_kernels_with_plain_autograd_gradients():
    # a one-layer DNN in float32 on the CPU that is offered memory for the input's gradient (grad_into: the NN
    # worker) computes its first layer with embedding.kernels.linear both ways; its output and every gradient equal
    # plain autograd's recomputed in float64, whether the gradient goes to other memory or over the input itself
    # (the ring slot), as without the offer (torch's product)
    torch.manual_seed(2)
    B, S, D, F = 33, 5, 8, 3
    model = DNN(S, D, F, hidden=[], bottom=[], dense_mean=[0.1, 0.2, 0.3], dense_std=[1.0, 2.0, 0.5])
    model.load_kernels()
    ref_model = DNN(S, D, F, hidden=[], bottom=[], dense_mean=[0.1, 0.2, 0.3], dense_std=[1.0, 2.0, 0.5]).double()
    ref_model.load_state_dict(model.state_dict())
    values = torch.randn(B, S, D)
    dense = torch.randn(B, F)
    w = torch.randn(B)
    ref_emb = values.double().requires_grad_(True)
    ref_out = ref_model(ref_emb, dense.double())
    (ref_out * w.double()).sum().backward()
    want = [ref_emb.grad] + [p.grad for p in ref_model.parameters()]
    calls = []
    for where in ("fresh", "other", "itself"):
        model.zero_grad()
        slot = values.clone()
        dst = {"fresh": None, "other": torch.full_like(values, 7.0), "itself": slot}[where]
        emb = slot.requires_grad_(True) if dst is None else grad_into(slot.requires_grad_(True), dst)
        real = (kernels.row_dots, kernels.row_dots_backward)
        kernels.row_dots = lambda *a, _f=real[0]: (calls.append("fwd"), _f(*a))[1]
        kernels.row_dots_backward = lambda *a, _f=real[1]: (calls.append("bwd"), _f(*a))[1]
        try:
            out = model(emb, dense)
            (out * w).sum().backward()
        finally:
            kernels.row_dots, kernels.row_dots_backward = real
        np.testing.assert_allclose(out.detach().double().numpy(), ref_out.detach().numpy(), rtol=1e-5, atol=1e-6)
        if dst is not None:
            assert emb.grad.data_ptr() == dst.data_ptr()
        got = [emb.grad] + [p.grad for p in model.parameters()]
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a.double().numpy(), b.numpy(), rtol=1e-5, atol=1e-5)
    assert calls == ["fwd", "bwd"] * 2  # the kernels ran where memory was offered, not torch's product
    # the kernels alone against a float64 recomputation, and their shape checks
    x = np.random.default_rng(0).normal(size=(9, 6)).astype(np.float32)
    wv = np.random.default_rng(1).normal(size=6).astype(np.float32)
    gy = np.random.default_rng(2).normal(size=9).astype(np.float32)
    y = np.empty(9, np.float32)
    row_dots(x, wv, np.float32(0.5), y)
    np.testing.assert_allclose(y, x.astype(np.float64) @ wv + 0.5, rtol=1e-5, atol=1e-6)
    gw, gx = np.empty(6, np.float32), x.copy()
    row_dots_backward(gx, gy, wv, gw, gx)  # gx over x itself
    np.testing.assert_allclose(gw, gy.astype(np.float64) @ x, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gx, np.outer(gy, wv), rtol=1e-6)
    with pytest.raises(ValueError, match="row_dots"):
        row_dots(x, wv[:5], np.float32(0.0), y)
    with pytest.raises(ValueError, match="row_dots_backward"):
        row_dots_backward(x, gy[:8], wv, gw, gx)
