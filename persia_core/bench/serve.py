"""``make bench-serve``: ``persia serve`` under open-loop load on 127.0.0.1, with the benchmarks' Criteo-shaped DLRM.

The model: the DLRM of ``make bench`` (``criteo_synth.criteo_config_dict``: 26 slots of one ID, dim 16, bottom
13-512-256-64-16, top 512-256-1), trained one epoch on ``--train-rows`` rows of the synthetic Criteo-shaped set.
The server runs in its own process (``python -m persia_core serve``) as a user starts it.

Instances: ``--distinct-rows`` (at least 1M) rows drawn from the same planted distribution, as raw Criteo fields
(``C1..C26`` 8-hex-digit strings, ``I1..I13`` integer counts), each sent once per pass over them in order, so no
cache of predictions or rows can help. Bodies are built before each phase.

Load: open loop (requests start on a fixed schedule whatever the server's replies, each over a pooled aiohttp
connection; its latency counts from its scheduled start, so a server that falls behind is charged its queue,
not hidden by it: no coordinated omission). The load generator is aiohttp's client (a locust or wrk-style
closed loop of users would slow down with the server instead). Phases of ``--phase-seconds`` each:

1. 100-row requests at rising rates (x1.25 from ``--start-rate`` requests/s) until one is not sustained (an
   error, or a p99 latency above ``--max-p99-ms``, or requests still unanswered 5 s after the phase), then
   ``--bisect`` phases at the geometric middle of the highest sustained rate and the lowest one that was not (the
   search's resolution goes from 25% to about 6%): the highest sustained rate is ``rows_per_s_100``, its p50
   ``p50_ms_100``; after a phase that was not sustained, the next waits for the server's requests in flight;
2. 100-row requests at half that rate: ``p99_ms_100_half_load``;
3. 1-row requests at 200/s: ``p99_ms_1``.

The server follows a blessed-model location (``persia serve --follow``): a third of the way through phase 2 a new
model (the same with its dense weights scaled by 0.9) is blessed there; ``swap_seconds`` is the time from its
marker being written to the first reply from it, ``failed_during_swap`` the errors and unanswered requests of that
phase, ``old_model_replies_after_swap`` the replies from the old model after the first from the new one (requests
that started before the swap). Two thirds of the way through, deltas arrive (``persia serve --deltas``): those of a
run that warm-started from the new model (trained before the load phases, on the same rows, with
``delta_every_s`` 2; their files are moved into the served delta folder at once); ``deltas_seconds`` is the time
from their arrival to the first reply from the rows with every delta applied, ``deltas`` their number. With
``--model`` (no training data here) no deltas arrive.

Last line: one JSON object with those figures, ``errors`` (failed or unanswered requests of the phases 2 and 3;
the search's sustained rates had none by definition, and those of the rates that were not are in its details)
and the phases' details.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np

from persia_core.argchecks import float_in, int_at_least
from persia_core.train.processes import free_port


def log(msg: str) -> None:
    print(f"[bench-serve {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def instance_fragments(n: int, seed: int = 1) -> list[bytes]:
    """``n`` raw Criteo rows of the planted distribution as JSON object texts (no label)."""
    from persia_core.bench.criteo_synth import DENSE, NUM_DENSE, SLOTS, PlantedModel

    planted = PlantedModel(0)
    rng = np.random.default_rng([seed, 7])
    out: list[bytes] = []
    for start in range(0, n, 100_000):
        k = min(100_000, n - start)
        ranks, _ = planted.sample_features(rng, k)
        counts = np.floor(np.exp(rng.normal(planted.mu, 1.2, size=(k, NUM_DENSE)))).astype(np.int64)
        for r in range(k):
            inst: dict[str, int | str] = {d: int(c) for d, c in zip(DENSE, counts[r], strict=True)}
            inst.update({s: f"{v:08x}" for s, v in zip(SLOTS, ranks[r], strict=True)})
            out.append(json.dumps(inst, separators=(",", ":")).encode())
    return out


def train_model(work: str, train_rows: int) -> str:
    from persia_core.bench.criteo_synth import write_criteo_synth
    from persia_core.config import RunConfig
    from persia_core.train.launcher import train

    data, model = os.path.join(work, "data"), os.path.join(work, "model")
    schema = write_criteo_synth(data, train_rows, eval_rows=1000)
    train(RunConfig.from_dict(schema["config"]), data, model, work_dir=os.path.join(work, "train"))
    return model


def stage_deltas(work: str, base: str) -> str:
    """Train one epoch on ``work/data`` warm-started from the Model ``base``, writing deltas every 2 s into
    ``work/deltas-staged``, which is returned."""
    from persia_core.config import RunConfig
    from persia_core.embedding.plan import init_shards
    from persia_core.model_store import read_manifest
    from persia_core.train.launcher import train

    data, staged = os.path.join(work, "data"), os.path.join(work, "deltas-staged")
    for old in (staged, os.path.join(work, "init-3"), os.path.join(work, "model-3")):
        shutil.rmtree(old, ignore_errors=True)
    config = RunConfig.from_dict(read_manifest(base)[1].config)  # the config only, not its rows
    init_shards(config, data, os.path.join(work, "init-3"), warm_start_from=base)
    train(
        config,
        data,
        os.path.join(work, "model-3"),
        init_dir=os.path.join(work, "init-3"),
        work_dir=os.path.join(work, "train-3"),
        delta_every_s=2.0,
        delta_dir=staged,
    )
    return staged


def deliver_deltas(staged: str, target: str) -> int:
    """Move the delta files of ``staged`` into ``target`` (each renamed into place, shard by shard in order, so a
    reader never sees a partial file). Returns how many."""
    n = 0
    for shard in sorted(os.listdir(staged)):
        os.makedirs(os.path.join(target, shard), exist_ok=True)
        for name in sorted(os.listdir(os.path.join(staged, shard))):
            if name.startswith("delta-"):
                os.replace(os.path.join(staged, shard, name), os.path.join(target, shard, name))
                n += 1
    return n


def last_deltas(delta_dir: str, num_shards: int) -> str:
    """The suffix ``persia serve`` adds to the model version once every delta of ``delta_dir`` is applied."""
    from persia_core.embedding.delta import list_deltas

    last = [max((q for q, _ in list_deltas(delta_dir, s)), default=0) for s in range(num_shards)]
    return "+deltas-" + ".".join(map(str, last))


def start_server(blessed: str, work: str, threads: int, deltas: str = "") -> tuple[subprocess.Popen, int]:
    """``persia serve --follow blessed [--deltas deltas]`` on a free port, once its health route answers."""
    port = free_port()
    logf = open(os.path.join(work, "serve.log"), "wb")
    args = ["--follow", blessed, "--poll-seconds", "1", "--port", str(port), "--threads", str(threads)]
    if deltas:
        args += ["--deltas", deltas]
    proc = subprocess.Popen(
        [sys.executable, "-m", "persia_core", "serve", *args],
        stdout=logf,
        stderr=logf,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"persia serve exited with {proc.returncode}; see {logf.name}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"persia serve did not answer its health route within 120 s; see {logf.name}")


class Rows:
    """Walks the distinct rows in order, wrapping around."""

    def __init__(self, fragments: list[bytes]):
        self.fragments, self.at = fragments, 0

    def body(self, n: int) -> bytes:
        f, k = self.fragments, len(self.fragments)
        part = f[self.at : self.at + n] if self.at + n <= k else f[self.at :] + f[: self.at + n - k]
        self.at = (self.at + n) % k
        return b'{"instances":[' + b",".join(part) + b"]}"


async def _phase(url: str, bodies: list[bytes], rate: float, rows: int) -> dict:
    import aiohttp

    latencies: list[float] = []
    errors: list[str] = []
    answered: list[tuple[float, str]] = []  # (Unix time of the reply, the model version that answered)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        loop = asyncio.get_running_loop()
        t0 = loop.time() + 0.05

        async def one(i: int, body: bytes) -> None:
            due = t0 + i / rate
            try:
                async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                    payload = await r.read()
                    if r.status != 200:
                        errors.append(f"HTTP {r.status}: {payload[:200]!r}")
                        return
                    reply = json.loads(payload)
                    if len(reply["predictions"]) != rows:
                        errors.append("wrong number of predictions")
                        return
                    answered.append((time.time(), reply["model_version"]))
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                errors.append(repr(e))
                return
            latencies.append(loop.time() - due)

        tasks: list[asyncio.Task] = []
        for i, b in enumerate(bodies):  # each request started at its time (not thousands of tasks made up front)
            await asyncio.sleep(max(0.0, t0 + i / rate - loop.time()))
            tasks.append(asyncio.ensure_future(one(i, b)))
        end = t0 + len(bodies) / rate + 5.0
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, end - loop.time()))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    lat = np.array(latencies) * 1e3 if latencies else np.array([np.inf])
    return {
        "rate": rate,
        "rows_per_request": rows,
        "requests": len(bodies),
        "answered": len(latencies),
        "errors": len(errors),
        "unanswered": len(pending),
        "first_error": errors[0] if errors else None,
        "p50_ms": round(float(np.percentile(lat, 50)), 3),
        "p99_ms": round(float(np.percentile(lat, 99)), 3),
        "max_ms": round(float(lat.max()), 3),
        "answered_by": answered,
    }


def phase(url: str, rows: Rows, rate: float, per_request: int, seconds: float, during=()) -> dict:
    """One phase of ``seconds`` at ``rate`` requests/s of ``per_request`` rows; each ``(fraction, fn)`` of
    ``during``: ``fn()`` runs in a thread of its own that fraction of the way through."""
    n = max(1, int(round(rate * seconds)))
    bodies = [rows.body(per_request) for _ in range(n)]
    timers = [threading.Timer(seconds * f, fn) for f, fn in during]
    for t in timers:
        t.start()
    r = asyncio.run(_phase(url, bodies, rate, per_request))
    for t in timers:
        t.join()
    log(
        f"{per_request}-row requests at {rate:.0f}/s for {seconds:.0f} s: p50 {r['p50_ms']} ms, p99 {r['p99_ms']} "
        f"ms, errors {r['errors']}, unanswered {r['unanswered']}"
    )
    return r


def sustained(r: dict, max_p99_ms: float) -> bool:
    """Whether a phase's rate was sustained: no error, every request answered, p99 within ``max_p99_ms``."""
    return not r["errors"] and not r["unanswered"] and r["p99_ms"] <= max_p99_ms


def settle(port: int, timeout_s: float = 30.0) -> None:
    """Wait until the server has no prediction request in flight (its ``/metrics`` gauge), after a phase it did
    not keep up with, so that the next phase does not start behind."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            text = ""
        line = next((x for x in text.splitlines() if x.startswith("persia_serve_requests_in_flight ")), "")
        if line and float(line.split()[1]) == 0.0:
            return
        time.sleep(0.5)


def search_rate(url: str, rows: Rows, port: int, args, phases: list[dict]) -> tuple[dict | None, dict | None]:
    """The highest sustained rate of 100-row requests: rates rising x1.25 from ``args.start_rate`` until one is
    not sustained, then ``args.bisect`` phases at the geometric middle of the highest sustained rate and the lowest
    one that was not. Appends every phase to ``phases``; returns the best sustained phase and the first that was
    not (either None)."""
    best = failed = None
    rate = args.start_rate
    while True:
        r = phase(url, rows, rate, 100, args.phase_seconds)
        phases.append(r)
        if not sustained(r, args.max_p99_ms):
            failed = r
            break
        best = r
        rate *= 1.25
    low, high = (best["rate"] if best else 0.0), failed["rate"]
    for _ in range(args.bisect if best else 0):
        settle(port)
        rate = round((low * high) ** 0.5, 1)
        r = phase(url, rows, rate, 100, args.phase_seconds)
        phases.append(r)
        if sustained(r, args.max_p99_ms):
            best, low = r, rate
        else:
            high = rate
    settle(port)
    return best, failed


def other_model(model: str, out: str) -> str:
    """A copy of ``model`` whose dense weights are scaled by 0.9: another model, same tables, to bless mid-run."""
    import torch

    shutil.copytree(model, out)
    path = os.path.join(out, "dense.pt")
    state = torch.load(path, weights_only=True)
    torch.save({k: v * 0.9 if v.is_floating_point() else v for k, v in state.items()}, path)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train-rows", type=int_at_least(1000), default=200_000, help="rows the model trains on")
    p.add_argument("--distinct-rows", type=int_at_least(1), default=1_000_000, help="distinct instances sent")
    p.add_argument("--phase-seconds", type=float_in(1.0), default=30.0, help="length of each load phase")
    p.add_argument("--start-rate", type=float_in(1.0), default=80.0, help="first rate of 100-row requests per s")
    p.add_argument("--max-p99-ms", type=float_in(1.0), default=100.0, help="a rate with a higher p99 is not sustained")
    p.add_argument(
        "--bisect", type=int_at_least(0), default=2, help="phases between the last sustained rate and the next"
    )
    p.add_argument("--threads", type=int_at_least(0), default=0, help="persia serve --threads (default: its own)")
    p.add_argument("--model", default="", help="serve this Model instead of training one")
    p.add_argument("--work", default="", help="working folder (default: temporary, removed)")
    args = p.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="bench-serve-")
    os.makedirs(work, exist_ok=True)
    proc = None
    try:
        t0 = time.time()
        model = args.model or train_model(work, args.train_rows)
        log(f"model {model} ({time.time() - t0:.0f} s); building {args.distinct_rows} distinct instances")
        rows = Rows(instance_fragments(args.distinct_rows))
        from persia_core.evaluate.gate import bless
        from persia_core.model_store import latest_blessed_model
        from persia_core.serve.server import model_version

        blessed = os.path.join(work, "blessed")
        for old in (blessed, os.path.join(work, "model-2")):  # a reused --work
            shutil.rmtree(old, ignore_errors=True)
        bless(model, {}, blessed)
        first = model_version(latest_blessed_model(blessed) or "")
        second_model = other_model(model, os.path.join(work, "model-2"))
        staged, delta_dir = "", os.path.join(work, "deltas")
        shutil.rmtree(delta_dir, ignore_errors=True)
        if not args.model:
            t0 = time.time()
            staged = stage_deltas(work, second_model)
            log(f"deltas of a run warm-started from the second model staged ({time.time() - t0:.0f} s)")
        proc, port = start_server(blessed, work, args.threads, delta_dir if staged else "")
        url = f"http://127.0.0.1:{port}/predict"
        gc.collect()
        gc.freeze()  # the 1M instances and torch's objects live to the end: no collection need scan them again
        phase(url, rows, 20.0, 100, min(5.0, args.phase_seconds))  # warm-up, not counted
        phases: list[dict] = []
        best, _ = search_rate(url, rows, port, args, phases)
        errors = 0  # a sustained rate had none; those of the rates that were not are in their phases' details
        half = one = None
        swap: dict = {}

        def bless_second() -> None:
            bless(second_model, {}, blessed)
            swap["blessed_at"] = time.time()
            swap["version"] = model_version(latest_blessed_model(blessed) or "")

        def deliver() -> None:
            swap["deltas"] = deliver_deltas(staged, delta_dir)
            swap["deltas_at"] = time.time()

        if best is not None:  # at half load a new model is blessed a third of the way through (follow mode)
            during = [(1 / 3, bless_second)] + ([(2 / 3, deliver)] if staged else [])
            half = phase(url, rows, best["rate"] / 2, 100, args.phase_seconds, during=during)
            one = phase(url, rows, 200.0, 1, args.phase_seconds)
            phases += [half, one]
            errors += half["errors"] + one["errors"] + half["unanswered"] + one["unanswered"]
            new = [t for t, v in half["answered_by"] if v == swap.get("version")]
            if new:
                swap["seconds"] = round(min(new) - swap["blessed_at"], 3)
                swap["old"] = sum(1 for t, v in half["answered_by"] if v == first and t > min(new))
            swap["failed"] = half["errors"] + half["unanswered"]
            log(f"swap: blessed {swap.get('version')}, first reply from it {swap.get('seconds')} s later")
            if staged:
                from persia_core.model_store import read_manifest

                shards = read_manifest(second_model)[1].num_shards
                applied = [t for t, v in half["answered_by"] if v.startswith(f"{swap.get('version')}+deltas-")]
                every = swap.get("version", "") + last_deltas(delta_dir, shards)
                full = [t for t, v in half["answered_by"] if v == every]
                if full:
                    swap["deltas_seconds"] = round(min(full) - swap["deltas_at"], 3)
                log(
                    f"deltas: {swap.get('deltas')} arrived, {len(applied)} replies from rows with deltas, all "
                    f"applied {swap.get('deltas_seconds')} s after their arrival"
                )
        for ph in phases:
            ph.pop("answered_by", None)
        result = {
            "rows_per_s_100": round(best["rate"] * 100) if best else 0,
            "p50_ms_100": best["p50_ms"] if best else None,
            "p99_ms_100_half_load": half["p99_ms"] if half else None,
            "p99_ms_1": one["p99_ms"] if one else None,
            "errors": errors,
            "swap_seconds": swap.get("seconds"),
            "failed_during_swap": swap.get("failed"),
            "old_model_replies_after_swap": swap.get("old"),
            "deltas": swap.get("deltas"),
            "deltas_seconds": swap.get("deltas_seconds"),
            "distinct_rows": args.distinct_rows,
            "phase_seconds": args.phase_seconds,
            "server_threads": args.threads,
            "phases": phases,
        }
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
