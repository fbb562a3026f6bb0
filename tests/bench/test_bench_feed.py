"""make bench-feed: per-role CPU accounting from /proc, and a tiny end-to-end run."""

import json
import os
import subprocess
import sys
import time

import pytest

from persia_core.bench import feed
from persia_core.bench.proc_cpu import ProcessSamples, ProcessTreeSampler


def test_roles_come_from_command_lines_and_add_up_to_the_total():
    cpu = {
        1: ("python -m persia_core.train.worker --config c", 2.0),
        2: ("python -m persia_core.ps.server --shard 0", 0.5),
        3: ("python -m persia_core.ps.server --shard 1", 0.5),
        4: ("python -m persia_core.train.embedding_worker --rank 0", 1.0),
        5: ("python -m persia_core.bench.feed", 0.25),
    }
    out = feed.per_sample(cpu, 1_000_000)
    assert out == {
        "nn_worker_cpu_us_per_sample": 2.0,
        "embedding_worker_cpu_us_per_sample": 1.0,
        "server_cpu_us_per_sample": 1.0,
        "launcher_cpu_us_per_sample": 0.25,
        "total_cpu_us_per_sample": 4.25,
    }


def test_cpu_at_interpolates_between_samples_and_is_zero_before_a_process_started():
    p = ProcessSamples(1, "x", times=[10.0, 12.0], cpu=[1.0, 2.0])
    assert p.cpu_at(9.0) == 0.0 and p.cpu_at(10.0) == 1.0 and p.cpu_at(11.0) == 1.5 and p.cpu_at(20.0) == 2.0


@pytest.mark.processes
def test_the_sampler_counts_a_busy_child_and_not_an_idle_one():
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass\n"
    with ProcessTreeSampler(interval_s=0.02) as sampler:
        t0 = time.time()
        procs = [
            subprocess.Popen([sys.executable, "-c", busy]),
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"]),
        ]
        for p in procs:
            p.wait(timeout=60)
        t1 = time.time()
    got = sampler.cpu_between(t0, t1)
    busy_cpu = got[procs[0].pid][1]
    idle_cpu = got[procs[1].pid][1]
    assert 0.8 <= busy_cpu <= 1.3  # its 1 s of CPU, less at most one sampling interval, plus start-up
    assert idle_cpu < 0.3  # its interpreter's start-up only
    assert "time.sleep(1.5)" in got[procs[1].pid][0]


def test_the_samplers_own_cpu_is_not_counted_as_the_root_processs():
    with ProcessTreeSampler(interval_s=0.001) as sampler:
        t0 = time.time()
        time.sleep(1.0)  # the root itself does nothing: only the sampling thread works
        t1 = time.time()
    own = sampler._own_cpu_s
    counted = sampler.cpu_between(t0, t1)[os.getpid()][1]
    assert own > 0.05  # sampling every millisecond costs the thread real CPU
    assert counted < 0.3 * own  # which is left out of the process's CPU


@pytest.mark.processes
def test_the_sampler_keeps_each_processs_peak_resident_memory():
    hold = "import time\nimport numpy as np\na = np.ones(300 << 20, np.uint8)\ntime.sleep(1.0)\n"
    with ProcessTreeSampler(interval_s=0.02) as sampler:
        procs = [
            subprocess.Popen([sys.executable, "-c", hold]),
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.0)"]),
        ]
        for p in procs:
            p.wait(timeout=60)
    big, small = (sampler.processes[p.pid].peak_rss for p in procs)
    assert 300 << 20 <= big < 450 << 20  # the 300 MiB it wrote, and its interpreter and numpy
    assert 0 < small < 64 << 20


@pytest.mark.processes
def test_bench_feed_runs_end_to_end_at_a_tiny_size(tmp_path, capsys):
    args = ["--samples", "16384", "--eval-rows", "2000", "--vocab", "2000", "--batch", "1024", "--work", str(tmp_path)]
    assert feed.main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["samples"] == 16384 and out["batch"] == 1024 and out["staleness"] == 4
    roles = ("nn_worker", "embedding_worker", "server", "launcher")
    assert out["nn_worker_cpu_us_per_sample"] > 0 and out["server_cpu_us_per_sample"] > 0
    total = sum(out[f"{r}_cpu_us_per_sample"] for r in roles)
    assert abs(out["total_cpu_us_per_sample"] - total) < 0.01
    assert out["plain_torch_sps"] > 0 and out["plain_torch_cpu_us_per_sample"] > 0
    expected = min(feed.DENSE_CEILING_SPS, 15 / (out["total_cpu_us_per_sample"] * 1e-6))
    assert abs(out["projected_16core_sps"] - expected) <= 1
    assert out["sps"] > 0 and out["train_loop_seconds"] > 0
    assert out["transport"] == "shared_memory" and out["dense_step_cpu_us_per_sample"] > 0


@pytest.mark.processes
def test_bench_feed_over_the_network_transport_counts_the_listening_embedding_workers(tmp_path, capsys):
    args = ["--samples", "4096", "--eval-rows", "500", "--vocab", "500", "--batch", "1024", "--work", str(tmp_path)]
    assert feed.main([*args, "--network", "--skip-plain"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["transport"] == "network" and out["embedding_workers"] == 2
    assert out["embedding_worker_cpu_us_per_sample"] > 0  # its listening processes, children of the benchmark
    assert "PERSIA_EMBEDDING_WORKER_ADDRESSES" not in os.environ
