"""The dense models against plain recomputations."""

import numpy as np
import torch

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
