"""Test helpers: run a training JobSet's pods on this machine as a kubelet would, each pod in a network namespace of
its own, and the same roles on 127.0.0.1 (as the Vertex AI tests do) for comparison.

``pods_of`` reads the JobSet and its Secret (``components.jobset.jobset_manifests``) into one ``Pod`` per pod of
every replicated job: its names (``<jobset>-<role>-<job>-<index>`` in the subdomain ``<jobset>``), its argv
(``command + args``, only ``python`` replaced by this interpreter) and its environment resolved the way the kubelet
resolves a container's ``env``. Whatever it does not know in a pod template (another ``valueFrom`` source, another
container field, a second container) raises ``ManifestError``: a change of the manifests' shape fails the test
instead of being run differently from how Kubernetes would run it.

``PodNetwork`` gives every pod a network namespace with one address on a bridge in the root namespace (veth pairs,
the peer end named ``eth0`` in the pod), ``lo`` up, and ``/etc/netns/<ns>/hosts`` written as the kubelet writes a
pod's ``/etc/hosts`` plus every other pod's names (which the cluster DNS resolves through the JobSet's headless
Service), so ``ip netns exec <ns>`` resolves the generated names. A pod's process also gets a UTS namespace whose
host name is the pod's (``unshare --uts``; Kubernetes sets it from ``spec.hostname``): gloo, like other libraries,
finds its own address by resolving the host name. Everything it creates goes on ``close``, even after a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import count
from typing import IO, Any

import pytest
from support import free_port_run

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
"""The downward-API field of an Indexed Job's pod that holds its index."""
BASIC_ENV = ("PATH", "HOME", "PYTHONPATH", "LANG", "LC_ALL", "TMPDIR", "USER")
"""Variables of this process a pod's process gets besides its manifest's (and ``OMP_NUM_THREADS=1``)."""
KNOWN_CONTAINER_FIELDS = {
    "name",
    "image",
    "command",
    "args",
    "env",
    "ports",
    "resources",
    "volumeMounts",
    "securityContext",
}
"""Container fields the emulation knows: ``image``, ``ports``, ``resources`` and ``securityContext`` are not enforced
(this checkout runs every pod; nothing is scheduled, limited, confined or firewalled)."""
KNOWN_MOUNTS = {"/dev/shm"}
"""Mount paths the emulation may ignore: a memory-backed ``/dev/shm`` is this machine's own."""


class ManifestError(ValueError):
    """The manifests hold something this emulation does not know how to run as Kubernetes would."""


def basic_env() -> dict[str, str]:
    """The environment every process started here has besides its own variables."""
    env = {k: os.environ[k] for k in BASIC_ENV if k in os.environ}
    env["OMP_NUM_THREADS"] = "1"
    return env


# ---- the kubelet's part: env and argv of each pod -------------------------------------------------------------
def expand(value: str, defined: Mapping[str, str]) -> str:
    """``value`` with ``$(VAR)`` references expanded as the kubelet expands them (``$$`` -> ``$``; a ``$`` before
    anything else, and an unclosed ``$(``, stay as they are). The kubelet leaves a reference to an undefined
    variable as it is; here that raises ``ManifestError`` (the process would receive a literal ``$(VAR)``)."""
    out: list[str] = []
    i = 0
    while i < len(value):
        c = value[i]
        if c != "$" or i + 1 == len(value):
            out.append(c)
            i += 1
            continue
        nxt = value[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            end = value.find(")", i + 2)
            if end < 0:  # unclosed: "$(" kept, the rest read on
                out.append("$(")
                i += 2
                continue
            var = value[i + 2 : end]
            if var not in defined:
                raise ManifestError(f"$({var}) refers to no variable defined before it in {value!r}")
            out.append(defined[var])
            i = end + 1
        else:
            out.append("$" + nxt)
            i += 2
    return "".join(out)


def secret_values(secret: dict) -> dict[str, str]:
    """A Secret's values by key (``stringData``, which the API server merges into ``data``)."""
    if secret.get("kind") != "Secret" or set(secret) - {"apiVersion", "kind", "metadata", "type", "stringData"}:
        raise ManifestError(f"not a Secret of stringData only: {sorted(secret)}")
    return {str(k): str(v) for k, v in secret["stringData"].items()}


def container_env(container: dict, index: int, secrets: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """The environment the kubelet gives ``container`` of the pod of completion index ``index`` (``secrets``: the
    values of each Secret by name). Raises ``ManifestError`` for a source it does not know."""
    if "envFrom" in container:
        raise ManifestError("envFrom is not emulated")
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        name = entry["name"]
        if set(entry) == {"name", "value"}:
            env[name] = expand(str(entry["value"]), env)
        elif set(entry) == {"name", "valueFrom"}:
            src = entry["valueFrom"]
            if set(src) == {"fieldRef"}:
                path = src["fieldRef"].get("fieldPath")
                if path != COMPLETION_INDEX or set(src["fieldRef"]) - {"fieldPath", "apiVersion"}:
                    raise ManifestError(f"{name}: fieldRef {src['fieldRef']} is not emulated")
                env[name] = str(index)
            elif set(src) == {"secretKeyRef"}:
                ref = src["secretKeyRef"]
                if set(ref) - {"name", "key"}:
                    raise ManifestError(f"{name}: secretKeyRef {ref} is not emulated")
                if ref["name"] not in secrets or ref["key"] not in secrets[ref["name"]]:
                    raise ManifestError(f"{name}: no key {ref['key']!r} in a Secret {ref['name']!r}")
                env[name] = secrets[ref["name"]][ref["key"]]
            else:
                raise ManifestError(f"{name}: valueFrom {sorted(src)} is not emulated")
        else:
            raise ManifestError(f"env entry {entry} is not emulated")
    return env


@dataclass
class Pod:
    """One pod of the JobSet as this machine runs it."""

    role: str
    """Its replicated job's name."""
    index: int
    """Its Job completion index."""
    hostname: str
    """``<jobset>-<role>-<job index>-<index>`` (JobSet's pod host name)."""
    subdomain: str
    """The JobSet's headless Service: ``<hostname>.<subdomain>`` is the pod's DNS name."""
    argv: list[str]
    env: dict[str, str]
    """Its manifest's variables only, resolved."""
    namespace: str = ""
    """The pod's Kubernetes namespace (its FQDN is ``<host>.<subdomain>.<namespace>.svc.cluster.local``)."""

    @property
    def dns_name(self) -> str:
        return f"{self.hostname}.{self.subdomain}"


def pods_of(jobset: dict, *secrets: dict) -> list[Pod]:
    """Every pod of ``jobset`` (replicated jobs in order, pods by index), with the values of ``secrets``.

    Raises ``ManifestError`` where a pod template holds what this emulation does not run as Kubernetes would."""
    if jobset.get("kind") != "JobSet":
        raise ManifestError(f"not a JobSet: {jobset.get('kind')}")
    values = {s["metadata"]["name"]: secret_values(s) for s in secrets}
    name, namespace = jobset["metadata"]["name"], jobset["metadata"].get("namespace", "")
    network = jobset["spec"].get("network", {})
    if not network.get("enableDNSHostnames"):
        raise ManifestError("spec.network.enableDNSHostnames is off: the pods would have no DNS names")
    subdomain = network.get("subdomain") or name
    pods = []
    for rjob in jobset["spec"]["replicatedJobs"]:
        spec = rjob["template"]["spec"]
        n = int(spec.get("parallelism", 1))
        if spec.get("completionMode") != "Indexed" or int(spec.get("completions", n)) != n:
            raise ManifestError(f"{rjob['name']}: only Indexed Jobs with completions == parallelism are emulated")
        pod_spec = spec["template"]["spec"]
        if set(pod_spec) - {"restartPolicy", "containers", "volumes", "serviceAccountName", "nodeSelector",
                            "tolerations", "securityContext"} or pod_spec.get("restartPolicy") != "Never":  # fmt: skip
            raise ManifestError(f"{rjob['name']}: pod spec fields {sorted(pod_spec)} are not all emulated")
        (container,) = pod_spec["containers"]
        if set(container) - KNOWN_CONTAINER_FIELDS:
            raise ManifestError(f"{rjob['name']}: container fields {sorted(set(container) - KNOWN_CONTAINER_FIELDS)}")
        mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
        if mounts - KNOWN_MOUNTS:
            raise ManifestError(f"{rjob['name']}: volume mounts {sorted(mounts - KNOWN_MOUNTS)} are not emulated")
        argv = list(container.get("command", [])) + list(container.get("args", []))
        if not argv or argv[0] != "python":
            raise ManifestError(f"{rjob['name']}: expected a command starting with python, got {argv[:3]}")
        argv[0] = sys.executable
        for j in range(int(rjob.get("replicas", 1))):
            for i in range(n):
                env = container_env(container, i, values)
                host = f"{name}-{rjob['name']}-{j}-{i}"
                pods.append(Pod(rjob["name"], i, host, subdomain, list(argv), env, namespace))
    return pods


# ---- the network --------------------------------------------------------------------------------------------
_seq = count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r


@dataclass
class PodNetwork:
    """One network namespace per pod on a bridge (see module docstring). Use as a context manager; ``pytest.skip``s
    where a namespace cannot be made (no permission, no ``ip``, not Linux), naming why."""

    pods: list[Pod]
    subnet: str = "10.231.0"
    """The /24 of the pods' addresses (``.2`` up); the bridge is a segment of its own, so two tests may share it."""
    tag: str = field(default_factory=lambda: f"{os.getpid() % 0xFFFFF:05x}{next(_seq) % 16:x}")
    namespaces: dict[str, str] = field(default_factory=dict)
    """Pod host name -> its network namespace."""
    addresses: dict[str, str] = field(default_factory=dict)
    """Pod host name -> its address."""
    procs: list[subprocess.Popen] = field(default_factory=list)
    _logs: list[IO[Any]] = field(default_factory=list)
    _made: list[tuple[str, str]] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"pk{self.tag}br"

    def __enter__(self) -> PodNetwork:
        if not sys.platform.startswith("linux") or shutil.which("ip") is None or shutil.which("unshare") is None:
            pytest.skip("network namespaces need Linux with iproute2's ip and util-linux's unshare")
        first = f"persia-{self.tag}-0"
        r = _ip("netns", "add", first, check=False)
        if r.returncode != 0:
            pytest.skip(f"cannot create a network namespace here: ip netns add: {r.stderr.strip()}")
        self._made.append(("netns", first))
        r = _ip("link", "add", self.bridge, "type", "bridge", check=False)
        if r.returncode != 0:
            self.close()
            pytest.skip(f"cannot create a bridge here: ip link add type bridge: {r.stderr.strip()}")
        self._made.append(("link", self.bridge))
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        _ip("link", "set", self.bridge, "up")
        for n, pod in enumerate(self.pods):
            ns, outer, inner = f"persia-{self.tag}-{n}", f"pk{self.tag}v{n:02d}", f"pk{self.tag}p{n:02d}"
            if n:
                _ip("netns", "add", ns)
                self._made.append(("netns", ns))
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            self._made.append(("link", outer))
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            addr = f"{self.subnet}.{n + 2}"
            _ip("-n", ns, "link", "set", inner, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.namespaces[pod.hostname], self.addresses[pod.hostname] = ns, addr
        for pod in self.pods:
            folder = f"/etc/netns/{self.namespaces[pod.hostname]}"
            os.makedirs(folder, exist_ok=True)
            self._made.append(("etc", folder))
            with open(os.path.join(folder, "hosts"), "w") as f:
                f.write(self.hosts_file(pod))

    def hosts_file(self, pod: Pod) -> str:
        """``/etc/hosts`` of ``pod``: the kubelet's (localhost, the pod's own names), then the other pods' names."""
        lines = ["# Kubernetes-managed hosts file (emulated).", "127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost"]
        for p in sorted(self.pods, key=lambda p: p is not pod):  # its own first, as the kubelet writes it
            names = [p.dns_name, p.hostname]
            if p.namespace:
                names.insert(0, f"{p.dns_name}.{p.namespace}.svc.cluster.local")
            lines.append(f"{self.addresses[p.hostname]}\t" + " ".join(names))
        return "\n".join(lines) + "\n"

    def command(self, pod: Pod, argv: list[str]) -> list[str]:
        """``argv`` run in ``pod``'s network namespace with its host name (the process is ``argv`` itself: ``ip
        netns exec``, ``unshare`` and ``sh`` each exec the next)."""
        return [
            "ip", "netns", "exec", self.namespaces[pod.hostname],
            "unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', pod.hostname, *argv,
        ]  # fmt: skip

    def start(self, pod: Pod, log_path: str) -> subprocess.Popen:
        """Start ``pod``'s process (its argv, its manifest's environment plus ``basic_env``; in the repository root,
        so ``persia_core`` is this checkout's), output to ``log_path``."""
        log = open(log_path, "w")
        self._logs.append(log)
        p = subprocess.Popen(
            self.command(pod, pod.argv),
            env={**basic_env(), **pod.env},
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: close() ends its children with it
        )
        self.procs.append(p)
        return p

    def run(self, pod: Pod, argv: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
        """Run ``argv`` to its end in ``pod``'s namespace (another process of that pod, e.g. a probe)."""
        return subprocess.run(
            self.command(pod, argv), env={**basic_env(), **env}, cwd=REPO, capture_output=True, text=True,
            timeout=timeout_s,
        )  # fmt: skip

    def close(self) -> None:
        """End the processes started here (their process groups), then remove the namespaces, links and
        ``/etc/netns`` folders made here."""
        _end(self.procs)
        for log in self._logs:
            log.close()
        for kind, what in reversed(self._made):
            if kind == "etc":
                shutil.rmtree(what, ignore_errors=True)
            elif kind == "link":
                _ip("link", "del", what, check=False)
            else:
                _ip("netns", "del", what, check=False)
        try:
            os.rmdir("/etc/netns")  # only where empty: it may hold other namespaces' folders
        except OSError:
            pass
        gone = time.monotonic() + 10  # a veth end goes with its namespace a moment after it
        while time.monotonic() < gone and any(
            _ip("link", "show", w, check=False).returncode == 0 for k, w in self._made if k == "link"
        ):
            time.sleep(0.1)
        self._made.clear()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _end(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each process group still running, SIGKILL those left after 10 s."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the group: children that outlived their parent too
        except (ProcessLookupError, PermissionError):
            pass
        p.wait()


def wait_all(procs: dict[str, subprocess.Popen], timeout_s: float) -> dict[str, int | None]:
    """Wait until every process has exited or ``timeout_s`` has passed. Returns each one's exit code (None: still
    running); stops waiting at the first failure."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = {k: p.poll() for k, p in procs.items()}
        if all(c is not None for c in codes.values()) or any(c not in (None, 0) for c in codes.values()):
            break
        time.sleep(0.2)
    return {k: p.poll() for k, p in procs.items()}


# ---- the same roles on 127.0.0.1 ------------------------------------------------------------------------------


def with_flags(argv: list[str], flags: list[str]) -> list[str]:
    """``argv`` with ``flags`` added to the entry point's own (before a ``--`` that starts the NN worker flags)."""
    i = argv.index("--") if "--" in argv else len(argv)
    return argv[:i] + flags + argv[i:]


def run_on_localhost(
    pods: list[Pod], listeners: Mapping[int, int], extra_args: list[str], log_dir: str, timeout_s: float
) -> dict[str, str]:
    """Run ``pods``' roles as the Vertex AI tests run replicas: every process on 127.0.0.1 with a Vertex-style
    ``CLUSTER_SPEC`` (``environment: cloud``, free ports; ``listeners``: pool -> ports each replica uses), each
    pod's argv with ``extra_args`` (``with_flags``), its manifest's variables but ``CLUSTER_SPEC`` and
    ``PERSIA_TASK_INDEX``. Asserts every one exits 0 within ``timeout_s``. Returns each one's log by pod host name."""
    from components.jobset import ROLE_JOBS

    pool_of = {role: pool for pool, role in ROLE_JOBS.items()}
    cluster: dict[str, list[str]] = {}
    for pod in pods:
        pool = pool_of[pod.role]
        cluster.setdefault(f"workerpool{pool}", []).append(f"127.0.0.1:{free_port_run(listeners.get(pool, 1))}")
    procs, logs = {}, {}
    try:
        for pod in pods:
            spec = {"cluster": cluster, "environment": "cloud"}
            spec["task"] = {"type": f"workerpool{pool_of[pod.role]}", "index": pod.index, "trial": ""}
            env = {k: v for k, v in pod.env.items() if k not in ("CLUSTER_SPEC", "PERSIA_TASK_INDEX")}
            env = {**basic_env(), **env, "CLUSTER_SPEC": json.dumps(spec)}
            logs[pod.hostname] = open(os.path.join(log_dir, f"{pod.hostname}.localhost.log"), "w")
            procs[pod.hostname] = subprocess.Popen(
                with_flags(pod.argv, extra_args),
                env=env,
                cwd=REPO,
                stdout=logs[pod.hostname],
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        codes = wait_all(procs, timeout_s)
    finally:
        _end(list(procs.values()))
        for f in logs.values():
            f.close()
    text = {k: open(os.path.join(log_dir, f"{k}.localhost.log")).read() for k in procs}
    assert all(c == 0 for c in codes.values()), (codes, {k: v[-3000:] for k, v in text.items()})
    return text
