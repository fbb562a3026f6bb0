"""``persia_core.host``: the CPUs a process may use, with and without a CPU affinity."""

import os

from persia_core.host import usable_cpus


def test_usable_cpus_is_the_affinity_where_the_os_has_one_else_the_cpu_count(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert usable_cpus() == 3
    monkeypatch.delattr(os, "sched_getaffinity")  # macOS, Windows
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert usable_cpus() == 6
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # undeterminable
    assert usable_cpus() == 1
