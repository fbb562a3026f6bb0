"""The shard plan's memory estimate: a table whose distinct IDs outgrow a shard's budget is refused, unless the
config says that the tables evict at capacity (PERSIA's LRU), when the estimate is the capacity."""

import pytest
from support import tiny_config

from persia_core.config import RunConfig
from persia_core.embedding.plan import PlanError, make_plan
from persia_core.memory import bytes_per_row, capacity_for_budget


def _config(**embedding) -> RunConfig:
    d = tiny_config().to_dict()
    d["embedding"].update(embedding)
    return RunConfig.from_dict(d)


def _schema(ids_per_slot: int) -> dict:
    return {"distinct_ids": {"a": ids_per_slot, "b": ids_per_slot, "tags": ids_per_slot}}


def test_a_plan_whose_ids_outgrow_the_budget_is_refused_naming_both_settings():
    cfg = _config()
    cap = capacity_for_budget(cfg.embedding.shard_memory_bytes, "rowwise_adagrad", 4)
    with pytest.raises(PlanError, match=r"embedding.shard_memory_bytes.*embedding.evict_at_capacity"):
        make_plan(cfg, _schema(cap))  # 3 slots x cap IDs over 2 shards: 1.5 x cap rows per shard


def test_with_evict_at_capacity_the_plan_holds_each_shard_at_its_capacity_and_says_it_evicts():
    cfg = _config(evict_at_capacity=True)
    cap = capacity_for_budget(cfg.embedding.shard_memory_bytes, "rowwise_adagrad", 4)
    plan = make_plan(cfg, _schema(cap))
    t = plan["tables"]["default"]
    assert t["estimated_ids"] == 3 * cap and t["evicts"]
    assert t["estimated_rows_per_shard"] == cap
    assert t["estimated_bytes_per_shard"] == int(cap * bytes_per_row("rowwise_adagrad", 4, cap))
    assert plan["estimated_bytes_per_shard"] == t["estimated_bytes_per_shard"]
    # within capacity nothing changes, and nothing is said to evict
    small = make_plan(cfg, _schema(10))
    assert not small["tables"]["default"]["evicts"]
    assert small == {**make_plan(_config(), _schema(10)), "evict_at_capacity": True}
