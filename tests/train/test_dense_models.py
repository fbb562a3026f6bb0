"""The dense models against plain recomputations."""

import numpy as np
import torch

from persia_core.models.dense import DLRM


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
