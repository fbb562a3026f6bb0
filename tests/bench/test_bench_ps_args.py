"""``python -m persia_core.bench.ps``: arguments out of range are refused by argparse (exit 2, naming the flag);
the smallest sizes it accepts run end to end."""

import json
import subprocess
import sys

import pytest


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "persia_core.bench.ps", *args], capture_output=True, text=True, timeout=240
    )


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--rows", "-5"], "--rows"),
        (["--rows", "10", "--batch", "100"], "--rows"),
        (["--rows", "1023"], "--rows"),
        (["--batch", "0"], "--batch"),
        (["--repeats", "-1"], "--repeats"),
        (["--repeats", "0"], "--repeats"),
    ],
)
@pytest.mark.processes
def test_bench_ps_refuses_out_of_range_sizes_naming_the_flag(args, flag):
    p = _run(*args)
    assert p.returncode == 2
    assert f"argument {flag}: must be >=" in p.stderr and "Traceback" not in p.stderr
    assert p.stdout == ""  # refused before any work


@pytest.mark.processes
def test_bench_ps_runs_at_the_smallest_sizes_it_accepts():
    p = _run("--rows", "1024", "--batch", "1", "--repeats", "1")
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["live_ids"] == 1024 and result["batch_raw_ids"] == 1
    assert result["lookups_per_s_per_core"] > 0 and result["grpc_ids_per_s"] > 0
