"""Sum pooling of a batch's bags into ``[B, S, D]`` on torch tensors (evaluation's path, and the reference of the
compiled kernels). Slot layout and dedup: ``persia_core.embedding.layout``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from persia_core.embedding.layout import PreparedIds


def pool_bags(
    rows: torch.Tensor,
    inverse: torch.Tensor,
    offsets: torch.Tensor,
    num_slots: int,
    batch_size: int,
    one_per_bag: bool = False,
) -> torch.Tensor:
    """Sum-pool the rows of each bag: ``rows: float32[U, D]``, ``inverse: int64[N]`` (row of each ID),
    ``offsets: int64[S_t*B + 1]`` -> ``float32[B, S_t, D]``, on the tensors' device.

    An empty bag pools to exact zeros and sends zero gradient; the gradient reaching ``rows`` is summed per
    unique ID (``embedding_bag``'s backward). ``one_per_bag``: the caller knows every bag holds exactly one ID
    (N = S_t*B), so the sum is a gather (``index_select``, whose backward sums per unique ID too; faster than
    ``embedding_bag``)."""
    if one_per_bag:
        out = rows.index_select(0, inverse)
        return out.view(num_slots, batch_size, rows.shape[1]).transpose(0, 1)
    out = F.embedding_bag(inverse, rows, offsets, mode="sum", include_last_offset=True)
    return out.view(num_slots, batch_size, rows.shape[1]).transpose(0, 1)


def pool(rows: torch.Tensor, prep: PreparedIds, num_slots: int, batch_size: int) -> torch.Tensor:
    """``pool_bags`` over a host-side ``PreparedIds``."""
    return pool_bags(
        rows, torch.from_numpy(prep.inverse), torch.from_numpy(prep.offsets), num_slots, batch_size, prep.one_per_bag
    )
