"""Start the roles of a training job as local processes, watch them, and collect the Model artifact.

Roles: N embedding parameter servers (``persia_core.ps.server``, one per shard, gRPC on 127.0.0.1 with a fresh
shared token) and M NN workers (``persia_core.train.worker``, torch DDP over gloo). When every worker exits 0,
each server dumps its shard into the model folder and ``manifest.json`` is written last. If any process dies, the
rest are killed within seconds and ``TrainingFailed`` names the process and its last log lines; children also
die with the launcher (``PR_SET_PDEATHSIG``), so no process is left behind.

Model folder::

    manifest.json          format, config, tables, shard files, dense file, slots, dense feature stats, summary
    dense.pt               dense model state_dict (load with torch.load(..., weights_only=True))
    shards/shard-SSSSS.npz one per parameter-server shard: <table>.keys/.weights/<optimizer state> (no pickles)
    train_metrics.json     loss curve, samples/s, observed staleness
    logs/                  each process's log
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass

from persia_core import io
from persia_core.config import RunConfig

FORMAT = "persia-model/1"
_PR_SET_PDEATHSIG = 1


class TrainingFailed(RuntimeError):
    """A training process failed; the message names it and ends with its last log lines."""


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen
    log_path: str

    def tail(self, n: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(deque(f, maxlen=n))
        except OSError:
            return "(no log)"


def shard_file_name(shard: int) -> str:
    return f"shards/shard-{shard:05d}.npz"


class LocalCluster:
    """Parameter servers and NN workers as child processes of this one. Use as a context manager.

    Args:
        config_path: run config YAML every process loads. num_shards, num_workers: N and M.
        work_dir: logs and port files. plan_path / init_dir: shard plan and initial shard files (optional).
    """

    def __init__(self, config_path: str, num_shards: int, num_workers: int, work_dir: str, plan_path: str = "",
                 init_dir: str = ""):
        self.config_path = config_path
        self.num_shards = num_shards
        self.num_workers = num_workers
        self.work_dir = work_dir
        self.plan_path = plan_path
        self.init_dir = init_dir
        self.token = secrets.token_hex(16)
        self.servers: list[_Proc] = []
        self.workers: list[_Proc] = []
        self.addresses: list[str] = []
        os.makedirs(os.path.join(work_dir, "logs"), exist_ok=True)

    def _env(self, **extra) -> dict:
        env = dict(os.environ)
        env["PERSIA_PS_TOKEN"] = self.token
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def _spawn(self, name: str, args: list[str], env: dict) -> _Proc:
        log_path = os.path.join(self.work_dir, "logs", f"{name}.log")
        f = open(log_path, "w")
        popen = subprocess.Popen([sys.executable, *args], stdout=f, stderr=subprocess.STDOUT, env=env,
                                 preexec_fn=_die_with_parent)
        f.close()
        return _Proc(name, popen, log_path)

    def start_servers(self, timeout_s: float = 120.0) -> list[str]:
        """Start the N servers and wait until each reports its port. Returns their addresses."""
        port_files = []
        for s in range(self.num_shards):
            pf = os.path.join(self.work_dir, f"ps-{s}.port")
            port_files.append(pf)
            args = ["-m", "persia_core.ps.server", "--config", self.config_path, "--shard", str(s),
                    "--num-shards", str(self.num_shards), "--port-file", pf]
            if self.plan_path:
                args += ["--plan", self.plan_path]
            if self.init_dir:
                init = io.join(self.init_dir, shard_file_name(s))
                if io.exists(init):
                    args += ["--init", init]
            self.servers.append(self._spawn(f"ps-{s}", args, self._env()))
        deadline = time.monotonic() + timeout_s
        for proc, pf in zip(self.servers, port_files):
            while not os.path.exists(pf):
                self._check_alive(self.servers)
                if time.monotonic() > deadline:
                    raise TrainingFailed(f"{proc.name} did not start serving within {timeout_s:.0f} s; "
                                         f"last log lines:\n{proc.tail()}")
                time.sleep(0.05)
            with open(pf) as f:
                self.addresses.append(f"127.0.0.1:{int(f.read())}")
        return self.addresses

    def start_workers(self, data_dir: str, out_dir: str) -> None:
        port = free_port()
        for r in range(self.num_workers):
            env = self._env(RANK=r, WORLD_SIZE=self.num_workers, LOCAL_RANK=r, MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=port, PERSIA_PS_ADDRESSES=",".join(self.addresses))
            args = ["-m", "persia_core.train.worker", "--config", self.config_path, "--data", data_dir,
                    "--out", out_dir]
            self.workers.append(self._spawn(f"nn_worker-{r}", args, env))

    def _check_alive(self, procs: list[_Proc], allow_clean_exit: bool = False) -> None:
        for p in procs:
            rc = p.popen.poll()
            if rc is not None and (rc != 0 or not allow_clean_exit):
                raise TrainingFailed(f"{p.name} (pid {p.popen.pid}) exited with code {rc}; last log lines:\n"
                                     f"{p.tail()}")

    def wait_workers(self, timeout_s: float | None = None) -> None:
        """Block until all workers exit 0. Any failure (a worker or a server dying) raises ``TrainingFailed``
        within about a second."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._check_alive(self.servers)
            self._check_alive(self.workers, allow_clean_exit=True)
            if all(p.popen.poll() == 0 for p in self.workers):
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TrainingFailed(f"training did not finish within {timeout_s:.0f} s")
            time.sleep(0.2)

    def stop(self) -> None:
        """Terminate every child (SIGTERM, then SIGKILL after 5 s) and reap it."""
        procs = self.workers + self.servers
        for p in procs:
            if p.popen.poll() is None:
                p.popen.terminate()
        deadline = time.monotonic() + 5
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def train(config: RunConfig, data_dir: str, model_dir: str, init_dir: str = "", work_dir: str = "") -> dict:
    """Run hybrid training with ``embedding.num_shards`` parameter servers and ``trainer.num_workers`` NN
    workers on this machine; write the Model artifact to ``model_dir`` (see module docstring).

    Returns the manifest. Raises ``TrainingFailed`` when a process fails, ``FileNotFoundError`` for missing
    inputs."""
    from persia_core.data.reader import read_schema
    from persia_core.ps.client import EmbeddingClient

    schema = read_schema(data_dir)
    io.makedirs(model_dir)
    work_dir = work_dir or tempfile.mkdtemp(prefix="persia-train-")
    os.makedirs(work_dir, exist_ok=True)
    cfg_path = os.path.join(work_dir, "run_config.yaml")
    with open(cfg_path, "w") as f:
        f.write(config.to_yaml())
    plan_path = io.join(init_dir, "shard_plan.json") if init_dir else ""
    if plan_path and not io.exists(plan_path):
        plan_path = ""
    n, m = config.embedding.num_shards, config.trainer.num_workers
    t0 = time.time()
    with LocalCluster(cfg_path, n, m, work_dir, plan_path, init_dir) as cluster:
        addresses = cluster.start_servers()
        cluster.start_workers(data_dir, model_dir)
        cluster.wait_workers()
        client = EmbeddingClient(addresses, config.embedding, token=cluster.token)
        try:
            shard_bytes = client.dump([io.join(model_dir, shard_file_name(s)) for s in range(n)])
            stats = client.stats()
        finally:
            client.close()
    history = json.loads(io.read_text(io.join(model_dir, "train_metrics.json")))
    history["shards"] = [{"shard": s["shard"], "rows": sum(t["rows"] for t in s["tables"].values()),
                          "bytes": shard_bytes[i], "evictions": sum(t["evictions"] for t in s["tables"].values()),
                          "dropped_gradients": sum(t["dropped_gradients"] for t in s["tables"].values())}
                         for i, s in enumerate(stats)]
    io.write_text(io.join(model_dir, "train_metrics.json"), json.dumps(history))
    manifest = {
        "format": FORMAT,
        "config": config.to_dict(),
        "num_shards": n,
        "shard_files": [shard_file_name(s) for s in range(n)],
        "dense_file": "dense.pt",
        "slots": [s.name for s in config.slots],
        "dense": schema["dense"],
        "dense_mean": schema.get("dense_mean"),
        "dense_std": schema.get("dense_std"),
        "summary": {"samples_per_s": history["samples_per_s"], "max_staleness": history["max_staleness"],
                    "final_loss": history["loss"][-1] if history["loss"] else None,
                    "wall_seconds": time.time() - t0, "rows": [s["rows"] for s in history["shards"]]},
    }
    for rel in ("dense.pt", *manifest["shard_files"]):
        if not io.exists(io.join(model_dir, rel)):
            raise TrainingFailed(f"training finished but {io.join(model_dir, rel)} is missing")
    io.write_text(io.join(model_dir, "manifest.json"), json.dumps(manifest, indent=1))
    return manifest
