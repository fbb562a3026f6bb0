"""What the local launcher needs from the operating system for its child processes: dying with the parent,
reading process states and trees from ``/proc``, signalling process groups, SIGTERM as an interrupt, free ports.

Linux-only parts (``PR_SET_PDEATHSIG``, ``/proc``) degrade to no effect where they are missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import threading
import time

_PR_SET_PDEATHSIG = 1
log = logging.getLogger("persia.processes")


PARENT_ENV = "PERSIA_DIE_WITH"
"""Environment variable of a child started by ``spawn``: the pid of the process it is to die with."""


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``), called by the
    child itself (see ``spawn``). No effect where libc has no ``prctl``."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def spawn(args: list[str], env: dict[str, str], **popen_kw) -> subprocess.Popen:
    """Start a child process (``subprocess.Popen(args, env=..., **popen_kw)``) that dies with this one: its main
    calls ``die_with_spawner`` first, which finds this process's pid in ``PERSIA_DIE_WITH``.

    Never with a ``preexec_fn``: that makes ``subprocess`` fork and run Python in the child before ``exec``, and
    in a process holding gRPC threads (the launcher's and replicas' clients) gRPC's fork handlers restart its
    poller in the child, which can abort it with SIGABRT."""
    return subprocess.Popen(args, env={**env, PARENT_ENV: str(os.getpid())}, **popen_kw)


def die_with_spawner() -> bool:
    """For a child's main, first thing: when ``PERSIA_DIE_WITH`` names the process that started it (``spawn``),
    die when that one dies (``die_with_parent``), and take the variable out of this process's environment so that
    its own children do not inherit it. Returns False when that process had already exited (exit at once)."""
    pid = os.environ.pop(PARENT_ENV, "")
    if not pid:
        return True
    die_with_parent()
    return os.getppid() == int(pid)


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3, the state, first), or None where it
    cannot be read (no ``/proc``, the process gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 :].split()  # the command name, in parentheses, may hold ' ' or ')'
    except (OSError, ValueError):
        return None


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (``/proc/<pid>/stat`` field 22, clock ticks since boot): with the pid, it
    names one process, not a later one given the same pid. None when it is gone, a zombie or cannot be read."""
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 20 or fields[0] == b"Z":
        return None
    return fields[19].decode()


def end_with(pid: int, sig: int = signal.SIGTERM, every_s: float = 0.5) -> bool:
    """Send ``sig`` to this process once process ``pid`` has ended, even by SIGKILL (a daemon thread checks every
    ``every_s`` seconds). For a process that ``pid`` did not start directly (``PR_SET_PDEATHSIG`` then cannot
    help): a kfp.local task runs under a shell. Returns False, and watches nothing, when ``pid`` is already gone
    or ``/proc`` cannot tell."""
    born = _start_time(pid)
    if born is None:
        return False

    def watch() -> None:
        while _start_time(pid) == born:
            time.sleep(every_s)
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name=f"end-with-{pid}", daemon=True).start()
    return True


def die_with_local_runner() -> None:
    """For a pipeline task's process, first thing: when ``pipelines.run_local`` started it (through kfp.local,
    ``PERSIA_DIE_WITH`` in the environment), get SIGTERM once run_local has ended, even by SIGKILL (``end_with``),
    so that the task stops its own processes and ends instead of running on orphaned; exit at once (143) when
    run_local is already gone. No effect in a task of any other runner (Vertex AI, Kubeflow), which sets no such
    variable."""
    pid = os.environ.pop(PARENT_ENV, "")
    if pid.isdigit() and not end_with(int(pid)):
        raise SystemExit(128 + signal.SIGTERM)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_stat(pid: int) -> tuple[str, int] | None:
    """``(state, parent pid)`` of process ``pid`` from ``/proc/<pid>/stat`` (state: ``R``, ``S``, ``D``, ``T``,
    ``t``, ``Z``...), or None where it cannot be read (no ``/proc``, the process gone)."""
    fields = _stat_fields(pid)
    try:
        return (fields[0].decode("ascii", "replace"), int(fields[1])) if fields is not None else None
    except (ValueError, IndexError):
        return None


def process_state(pid: int) -> str:
    """The one-letter state of process ``pid`` (``proc_stat``), or ``""`` where it cannot be read."""
    st = proc_stat(pid)
    return st[0] if st else ""


CGROUP_ROOT = "/sys/fs/cgroup"
"""Where the cgroup hierarchies are mounted: v1 controllers each in a folder of their own (``freezer``), cgroup v2
at the root itself or, on hybrid hosts, under ``unified``."""


def _cgroups(pid: int) -> list[tuple[str, str]]:
    """``(controllers, path)`` of each line of ``/proc/<pid>/cgroup`` ([] where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            out.append((parts[1], parts[2]))
    return out


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _freezer_folders(pid: int) -> list[tuple[str, bool]]:
    """``(folder, v1)`` of each cgroup holding process ``pid`` that has a freezer: v1's ``freezer`` hierarchy, and
    cgroup v2 at the root or, on hybrid hosts, under ``unified``."""
    out = []
    for controllers, path in _cgroups(pid):
        rel = path.lstrip("/")
        if "freezer" in controllers.split(","):
            out.append((os.path.join(CGROUP_ROOT, "freezer", rel).rstrip("/"), True))
        elif controllers == "":
            for mount in (CGROUP_ROOT, os.path.join(CGROUP_ROOT, "unified")):
                folder = os.path.join(mount, rel).rstrip("/")
                if os.path.exists(os.path.join(folder, "cgroup.events")):
                    out.append((folder, False))
    return out


def _self_frozen(folder: str, v1: bool) -> bool:
    """Whether cgroup ``folder`` itself was frozen (v1 ``freezer.self_freezing``, v2 ``cgroup.freeze``), not only
    through an ancestor."""
    return _read(os.path.join(folder, "freezer.self_freezing" if v1 else "cgroup.freeze")).strip() == "1"


def _freezing_chain(folder: str, v1: bool) -> list[str]:
    """The cgroups from ``folder`` up to its hierarchy's root that froze themselves, innermost first."""
    chain = []
    while os.path.exists(os.path.join(folder, "cgroup.procs")):
        if _self_frozen(folder, v1):
            chain.append(folder)
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    return chain


def frozen_cgroup(pid: int) -> str | None:
    """The folder of the cgroup whose freezer holds process ``pid`` frozen, or None (not frozen, gone, or no
    cgroup to read). A frozen process is alive and never runs, like a stopped one, but reads as state ``D`` (v1)
    or ``S`` (v2), not ``T``; its cgroup is frozen when v1's ``freezer.state`` is ``FROZEN`` or ``FREEZING``, or
    v2's ``cgroup.events`` says ``frozen 1``. Both also show a freeze made by an ancestor: the folder named is the
    nearest one that froze itself (v1 ``freezer.self_freezing``, v2 ``cgroup.freeze``), which is what to thaw."""
    for folder, v1 in _freezer_folders(pid):
        if v1:
            frozen = _read(os.path.join(folder, "freezer.state")).strip() in ("FROZEN", "FREEZING")
        else:
            frozen = "frozen 1" in _read(os.path.join(folder, "cgroup.events")).splitlines()
        if frozen:
            chain = _freezing_chain(folder, v1)
            return chain[0] if chain else folder
    return None


STOPPED_FAIL_S = 20.0
"""Seconds a supervised process may stay halted (``halted``) before its job fails: the local launcher's children,
and an NN worker's embedding workers."""


def halted(pid: int) -> str | None:
    """How process ``pid`` is halted, alive but never running: ``"stopped (SIGSTOP)"`` (state ``T``; not ``t``, a
    debugger's stop) or ``"frozen (by the freezer of cgroup <folder>)"`` (``frozen_cgroup``); None when it is not
    (running, asleep, busy in I/O, gone)."""
    if process_state(pid) == "T":
        return "stopped (SIGSTOP)"
    folder = frozen_cgroup(pid)
    return None if folder is None else f"frozen (by the freezer of cgroup {folder})"


class HaltWatch:
    """Since when each of a supervisor's processes has been halted (``halted``), to fail its job on one that stays
    halted for a limit."""

    def __init__(self) -> None:
        self.since: dict[int, float] = {}

    def check(self, pid: int, limit_s: float = STOPPED_FAIL_S) -> str | None:
        """``"has been <how> for N s"`` once process ``pid`` has been halted for ``limit_s`` seconds, else None."""
        how = halted(pid)
        if how is None:
            self.since.pop(pid, None)
            return None
        now = time.monotonic()
        first = self.since.setdefault(pid, now)
        return f"has been {how} for {now - first:.0f} s" if now - first >= limit_s else None


def thaw_if_only(folder: str, pids: set[int]) -> bool:
    """Thaw the frozen cgroup ``folder`` (``frozen_cgroup``), and every ancestor that froze itself too, when every
    process below the outermost of them is one of ``pids`` (this job's, being stopped), so that a SIGKILL can end
    them: the v1 freezer holds even a killed process until it is thawed. A frozen cgroup that also holds other
    processes is left as it is (someone else froze it). Returns whether it was thawed."""
    v1 = os.path.exists(os.path.join(folder, "freezer.state"))
    chain = _freezing_chain(folder, v1) or [folder]
    members: set[int] = set()
    for below, _, _ in os.walk(chain[-1]):
        members |= {int(x) for x in _read(os.path.join(below, "cgroup.procs")).split() if x.isdigit()}
    if not members or not members <= pids:
        return False
    try:
        for f in reversed(chain):  # the outermost first
            with open(os.path.join(f, "freezer.state" if v1 else "cgroup.freeze"), "w") as out:
                out.write("THAWED" if v1 else "0")
    except OSError:
        return False
    return True


KILLED_WAIT_S = 10.0
"""Seconds to wait for a SIGKILLed child to end before giving up on it (a process frozen by a cgroup that is not
this job's cannot end until someone thaws it): the job's failure is raised, not held."""


def reap_killed(popen: subprocess.Popen, name: str) -> None:
    """Wait for SIGKILLed child ``popen`` (``name``, for the log) to end. A frozen one's cgroup is thawed first when
    it holds only this process's descendants (``thaw_if_only``). Gives up after ``KILLED_WAIT_S``, logging the child
    and its cgroup."""
    folder = frozen_cgroup(popen.pid)
    if folder is not None and thaw_if_only(folder, set(descendants(os.getpid()))):
        log.warning("%s (pid %d): thawed its frozen cgroup %s so that it can end", name, popen.pid, folder)
    try:
        popen.wait(timeout=KILLED_WAIT_S)
    except subprocess.TimeoutExpired:
        log.error(
            "%s (pid %d) was killed but has not ended after %.0f s%s; not waiting for it",
            name,
            popen.pid,
            KILLED_WAIT_S,
            f" (frozen by the freezer of cgroup {folder}, which holds other processes too: thaw it)" if folder else "",
        )


def descendants(pid: int) -> list[int]:
    """The pids of every live process below ``pid`` (children, their children...), from ``/proc``; [] without it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        st = proc_stat(int(entry)) if entry.isdigit() else None
        if st is not None and st[0] != "Z":
            children.setdefault(st[1], []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def signal_group(popen: subprocess.Popen, sig: int) -> None:
    """Signal the process group a child leads (not yet reaped, so the id is still its own)."""
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            popen.send_signal(sig)
        except ProcessLookupError:
            pass


class Terminated(KeyboardInterrupt):
    """SIGTERM, the way Kubernetes, KFP and Vertex AI cancel a task, raised where Ctrl-C's KeyboardInterrupt is,
    so that the same cleanup runs (children stopped and reaped, shared-memory segments removed)."""


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Within the block, SIGTERM raises ``Terminated`` in the main thread instead of ending the process at once
    (Python's default), leaving no children and no ``/dev/shm`` segments behind. No effect off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
