"""Sum pooling of a batch's bags into ``[B, S, D]`` on torch tensors (evaluation's path, and the reference of the
compiled kernels), and the logits of a batch from read-only lookups (evaluation and the validation slice). Slot
layout and dedup: ``persia_core.embedding.layout``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from persia_core.config import WIDE_TABLE
from persia_core.embedding.backend import EmbeddingBackend
from persia_core.embedding.layout import PreparedIds, TableLayout, prepare_ids, prepare_wide
from persia_core.models.dense import wide_logit


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


def readonly_inputs(
    backend: EmbeddingBackend,
    layouts: list[TableLayout],
    wide: TableLayout | None,
    batch,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What the dense model takes for ``batch`` (a ``Batch`` in the layouts' slot order), every row read with
    ``backend.lookup_readonly`` (an unseen ID reads the zero row, nothing is created): ``(emb: float32[B, S, D],
    dense: float32[B, F], wide: float32[B] or None)``, ``wide`` the wide table's term of the logit when ``wide``
    is given. Call under ``torch.no_grad()``."""
    prepared = prepare_ids(batch.ids, layouts)
    pooled = []
    for t in layouts:
        rows = torch.from_numpy(backend.lookup_readonly(t.name, prepared[t.name].uniq))
        pooled.append(pool(rows, prepared[t.name], len(t.slots), batch.size))
    emb = (torch.cat(pooled, dim=1) if len(pooled) > 1 else pooled[0]).to(device)
    term = None
    if wide is not None:
        p = prepare_wide(batch.ids, wide, prepared)
        rows = torch.from_numpy(backend.lookup_readonly(WIDE_TABLE, p.uniq))
        term = wide_logit(pool(rows, p, len(wide.slots), batch.size).to(device))
    return emb, torch.from_numpy(batch.dense).to(device), term


def readonly_logits(
    dense: torch.nn.Module,
    backend: EmbeddingBackend,
    layouts: list[TableLayout],
    wide: TableLayout | None,
    batch,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Logits ``float32[B]`` of ``batch`` (a ``Batch`` in the layouts' slot order) by the dense model ``dense``, plus
    the wide table's term when ``wide`` is given, from ``readonly_inputs``. Call under ``torch.no_grad()``."""
    emb, values, term = readonly_inputs(backend, layouts, wide, batch, device)
    logits = dense(emb, values)
    return logits if term is None else logits + term
