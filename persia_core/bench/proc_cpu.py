"""CPU time and resident memory of a process tree over a wall-clock window, from ``/proc`` (Linux): what each role
of a job spends.

``ProcessTreeSampler`` reads, every ``interval_s``, the CPU time (user + system, all threads) and the resident set
size (RSS, bytes) of every descendant of a process and the process itself, with each one's command line;
the sampling thread's own CPU time is left out of the root's, when the root is this process (it is the
instrument's cost, not the job's);
``cpu_between(t0, t1)`` then interpolates each process's CPU seconds at the window's two ends (Unix seconds). A
process that started inside the window counts from zero; one that ended inside it counts up to its last sample (up
to ``interval_s`` of its CPU is lost). Each process keeps its peak RSS over the samples (``peak_rss``).
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from dataclasses import dataclass, field

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def _read_stat(pid: int) -> tuple[int, float, int] | None:
    """(parent pid, CPU seconds: utime + stime, RSS bytes) of ``pid`` from ``/proc/<pid>/stat``; None once it is
    gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces and parentheses
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS, int(fields[21]) * PAGE_BYTES


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


@dataclass
class ProcessSamples:
    """One process's samples: ``times`` (Unix seconds), ``cpu`` (CPU seconds then), in time order, and
    ``peak_rss``, the largest resident set size sampled (bytes)."""

    pid: int
    cmdline: str
    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    peak_rss: int = 0

    def cpu_at(self, t: float) -> float:
        """CPU seconds at ``t``, linear between samples; 0 before the first, the last value after the last."""
        if not self.times or t < self.times[0]:
            return 0.0
        i = bisect.bisect_right(self.times, t)
        if i >= len(self.times):
            return self.cpu[-1]
        t0, t1, c0, c1 = self.times[i - 1], self.times[i], self.cpu[i - 1], self.cpu[i]
        return c0 + (c1 - c0) * (t - t0) / max(t1 - t0, 1e-9)


class ProcessTreeSampler:
    """Samples the CPU time of ``root`` (default: this process) and all its descendants on a background thread.

    Use as a context manager; ``processes`` holds a ``ProcessSamples`` per pid seen (a pid reused by a new process,
    seen as CPU time going down, starts a new entry in its place)."""

    def __init__(self, root: int | None = None, interval_s: float = 0.05):
        self.root = root if root is not None else os.getpid()
        self.interval_s = interval_s
        self.processes: dict[int, ProcessSamples] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="proc-cpu-sampler", daemon=True)
        self._own_cpu_s = 0.0  # CPU seconds of the sampling thread so far (left out of the root's samples)

    def __enter__(self) -> ProcessTreeSampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()
            self._own_cpu_s = time.thread_time()  # this thread's CPU, all of it spent sampling

    def sample(self) -> None:
        """One pass over ``/proc``: every live descendant of ``root`` (and ``root``) gets a sample."""
        now = time.time()
        stats: dict[int, tuple[int, float, int]] = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                st = _read_stat(int(name))
                if st is not None:
                    stats[int(name)] = st
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        todo, tree = [self.root], []
        while todo:
            pid = todo.pop()
            if pid in stats:
                tree.append(pid)
                todo.extend(children.get(pid, []))
        for pid in tree:
            proc = self.processes.get(pid)
            if proc is None or (proc.cpu and stats[pid][1] < proc.cpu[-1]):  # new, or its pid reused
                proc = self.processes[pid] = ProcessSamples(pid, "")
            # read again every time: between fork and exec a child still shows its parent's command line
            proc.cmdline = _cmdline(pid) or proc.cmdline
            proc.times.append(now)
            own = self._own_cpu_s if pid == self.root == os.getpid() else 0.0
            proc.cpu.append(max(stats[pid][1] - own, proc.cpu[-1] if proc.cpu else 0.0))
            proc.peak_rss = max(proc.peak_rss, stats[pid][2])

    def cpu_between(self, t0: float, t1: float) -> dict[int, tuple[str, float]]:
        """pid -> (command line, CPU seconds spent between Unix times ``t0`` and ``t1``), for every process seen."""
        return {pid: (p.cmdline, max(0.0, p.cpu_at(t1) - p.cpu_at(t0))) for pid, p in self.processes.items()}
