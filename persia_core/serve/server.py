"""``persia serve``: an HTTP prediction server for a Model artifact, in Vertex AI's custom-container contract.

Routes (Vertex AI: https://cloud.google.com/vertex-ai/docs/predictions/custom-container-requirements):

- ``POST <predict route>`` (``AIP_PREDICT_ROUTE``, default ``/predict``): ``{"instances": [...]}`` ->
  ``{"predictions": [p, ...], "model_version": "..."}`` (click probabilities: float32 in the fewest digits that
  read back as the same float32; the
  ``X-Model-Version`` header says the same). Instances: ``persia_core.serve.instances``. A malformed body or
  instance gets 400 naming the instance index and field; a body over ``max_request_bytes`` gets 413.
- ``GET <health route>`` (``AIP_HEALTH_ROUTE``, default ``/health``): 200 ``{"status": "ok", "model_version"}``
  once the model is loaded.
- ``GET /metrics``: Prometheus text format (``prometheus_client``): requests by route and status, instances,
  requests in flight, request latency, the served model's version, load time and age, and with ``--deltas`` the
  deltas applied and the age of the newest one (its freshness).

The server is aiohttp (``aiohttp.web``): one asyncio event loop parses each request's body and instances and looks
its rows up (Python work that holds the GIL: threads would only add hand-offs of it), then runs its dense network in
one of ``threads`` worker threads (the traced network releases the GIL for its whole forward: ``traced_dense``), so
that one request's dense step runs beside the next one's parsing, and a health check waits at most for one request's
parsing; a request of up to ``INLINE_ROWS`` instances runs it on the loop, faster than the hand-off. SIGTERM and
SIGINT stop accepting connections and let the requests in flight finish (up to ``drain_s``) before exiting.
Embedding lookups are read-only and in-process (``LoadedModel``); the model must fit twice in memory
(``check_memory``) so that a new one can be loaded beside it. Follow mode (``Follower``) swaps to each model newly
blessed at a blessed-model location; ``--deltas`` applies a training run's delta files to the served model
(``persia_core.serve.deltas``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson
import torch

from persia_core import io
from persia_core.embedding.pooling import readonly_inputs
from persia_core.evaluate.run import LoadedModel
from persia_core.model_store import (
    BLESSED_MARKER,
    is_blessed_location,
    manifest_digest,
    read_manifest,
    read_marker,
)
from persia_core.serve.deltas import DeltaFeed
from persia_core.serve.instances import InstanceEncoder, InstanceError

log = logging.getLogger("persia.serve")

DEFAULT_PREDICT_ROUTE = "/predict"
DEFAULT_HEALTH_ROUTE = "/health"
DEFAULT_MAX_REQUEST_BYTES = 8 << 20
DEFAULT_BODY_TIMEOUT_S = 30.0
"""Seconds a request's body may take to arrive after its headers (then 408)."""
INLINE_ROWS = 8
"""Requests of at most this many instances run their dense network on the event loop: it takes less than handing
it to a worker thread and back."""


class ModelTooLargeError(MemoryError):
    """The model does not fit twice in the memory available to the server."""


def available_memory_bytes() -> int:
    """Bytes this process may still allocate: ``MemAvailable`` of ``/proc/meminfo``, lowered to the cgroup's
    ``memory.max`` less ``memory.current`` where a limit is set (a container's)."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read().strip())
        if limit != "max":
            avail = min(avail, int(limit) - current)
    except (OSError, ValueError):
        pass
    return max(int(avail), 0)


def model_bytes(model_dir: str) -> int:
    """Bytes of a Model artifact's dense file and shard files (uncompressed arrays: about what it holds in
    memory). ``model_dir`` may be a blessed-model location."""
    folder, manifest = read_manifest(model_dir)
    return sum(io.size(io.join(folder, rel)) for rel in (manifest.dense_file, *manifest.shard_files))


def check_memory(model_dir: str, available: int | None = None) -> int:
    """Refuse a model that does not fit twice in ``available`` bytes (default ``available_memory_bytes()``): a
    swap to a new model holds both. Returns the model's bytes. Raises ``ModelTooLargeError`` naming both
    figures."""
    need = model_bytes(model_dir)
    have = available_memory_bytes() if available is None else available
    if 2 * need > have:
        raise ModelTooLargeError(
            f"{model_dir}: the model needs {need} bytes in memory and twice that ({2 * need} bytes) to swap in a new "
            f"one, but {have} bytes are available; give the server more memory (a larger machine type)"
        )
    return need


def model_version(model_dir: str) -> str:
    """The version a response names: the model folder's name and the first 12 hex digits of the SHA-256 of its
    manifest (``model_store.manifest_digest``), e.g. ``model-3f1c9a0b2d4e``."""
    folder, _ = read_manifest(model_dir)
    return f"{os.path.basename(folder.rstrip('/')) or 'model'}-{manifest_digest(folder)[:12]}"


@dataclass
class Served:
    """The model being served: the loaded artifact, its instance encoder, version and load time (Unix s)."""

    model: LoadedModel
    encoder: InstanceEncoder
    version: str
    loaded_at: float
    folder: str


def traced_dense(model: LoadedModel) -> None:
    """Replace ``model.dense`` by its TorchScript trace (``torch.jit.trace``) when the trace computes the same
    logits as the module: the same aten operators, run in one call that releases the GIL for the whole forward,
    where the module takes the GIL back after each layer (and waits up to ``sys.getswitchinterval()`` for it each
    time another thread runs Python: a request's parsing, a model being loaded). Checked on random inputs of 1 and
    37 rows; a model that does not trace, or whose trace differs by more than 1e-6, stays as it is (a log line).
    torch 2.x deprecates tracing for ``torch.export``, whose CPU path (AOTInductor) compiles C++ at every load: the
    warning is silenced, and a torch without ``torch.jit.trace`` serves the module. ``serve`` runs the traces under
    ``torch.jit.optimized_execution(False)``: the profiling executor's plans (compiled on a trace's first calls and
    for each new row count) would cost requests time after every swap, and fuse nothing a dense CPU step gains by."""
    gen = torch.Generator().manual_seed(0)
    dim, slots, num_dense = model.layouts[0].dim, len(model.slots), len(model.manifest.dense)

    def example(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, slots, dim, generator=gen) * 0.1, torch.randn(b, num_dense, generator=gen).abs()

    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", torch.jit.TracerWarning)  # shape-dependent Python branches: fixed per model
            traced = torch.jit.trace(model.dense, example(4), check_trace=False)
            for b in (1, 37):
                emb, dense = example(b)
                diff = float((traced(emb, dense) - model.dense(emb, dense)).abs().max())
                if not diff <= 1e-6:
                    raise ValueError(f"its trace differs from it by {diff} on {b} rows")
    except Exception as e:  # serving works without the trace: only slower under load
        log.warning("%s: serving the dense network untraced: %s: %s", model.model_dir, type(e).__name__, e)
        return
    model.dense = traced


def load_served(model_dir: str) -> Served:
    """Load ``model_dir`` (a Model artifact or a blessed-model location) for serving (the dense network traced:
    ``traced_dense``)."""
    model = LoadedModel(model_dir)
    traced_dense(model)
    encoder = InstanceEncoder(model.config, model.slots, len(model.manifest.dense))
    served = Served(model, encoder, model_version(model.model_dir), time.time(), model.model_dir)
    warm_up(served)
    return served


def warm_up(served: Served) -> None:
    """Score one made-up instance the way a request is scored (``InstanceEncoder.batch``, ``readonly_inputs``, the
    dense network), so that the compiled kernels a request runs (hashing, lookups, pooling: from numba's cache, or
    compiled where it has none, seconds) are loaded at start-up or by the thread loading a new model, not on a
    request's time (``InstanceEncoder.example``)."""
    enc, m = served.encoder, served.model
    with torch.no_grad():
        emb, values, _ = readonly_inputs(m.embedding, m.layouts, m.wide, enc.batch([enc.example()]))
        m.dense(emb, values)


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (several servers in one process stay apart)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter(
            "persia_serve_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry
        )
        self.instances = Counter("persia_serve_instances", "instances scored", registry=self.registry)
        self.in_flight = Gauge(
            "persia_serve_requests_in_flight", "prediction requests read and not yet answered", registry=self.registry
        )
        self.latency = Histogram(
            "persia_serve_request_seconds",
            "prediction request latency, body read to response, in seconds",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=self.registry,
        )
        self.version = Gauge(
            "persia_serve_model_info", "the served model (value 1)", ["model_version"], registry=self.registry
        )
        self.loaded = Gauge(
            "persia_serve_model_loaded_timestamp_seconds", "when the served model was loaded", registry=self.registry
        )
        self.swaps = Counter(
            "persia_serve_model_swaps",
            "follow mode: swaps to a newly blessed model",
            ["result"],
            registry=self.registry,
        )
        self.freshness = Gauge(
            "persia_serve_model_age_seconds", "seconds since the served model was loaded", registry=self.registry
        )
        self.delta_age = Gauge(
            "persia_serve_delta_age_seconds",
            "--deltas: seconds since the newest delta applied was written (NaN before the first)",
            registry=self.registry,
        )
        self.delta_age.set(float("nan"))
        self.deltas_applied = Counter(
            "persia_serve_deltas_applied", "--deltas: delta files applied to the served model", registry=self.registry
        )
        self.newest_delta_at: float | None = None

    def serving(self, served: Served) -> None:
        self.version.clear()
        self.version.labels(served.version).set(1)
        self.loaded.set(served.loaded_at)

    def text(self, served: Served | None) -> bytes:
        from prometheus_client import generate_latest

        if served is not None:
            self.freshness.set(time.time() - served.loaded_at)
        self.delta_age.set(float("nan") if self.newest_delta_at is None else time.time() - self.newest_delta_at)
        return generate_latest(self.registry)


class Follower:
    """Follow mode: watches a blessed-model location and swaps the served model when its marker names a new one.

    At each ``check`` (every ``poll_s`` seconds of ``make_app``) the marker (``BLESSED.json``) is read; a model it
    names that is not the one served is loaded in a thread of its own (refused when it does not fit in the memory
    left: ``ModelTooLargeError``), then replaces the served one between two requests: a request keeps the model it
    started with, none fails. A model that cannot be loaded leaves the old one serving; ``error`` (health, and a log
    line) says why, and it is not tried again until the marker changes; a marker naming the served model again (a
    rollback) clears it."""

    def __init__(self, location: str, state: dict, metrics: Metrics):
        self.location, self.state, self.metrics = location, state, metrics
        self.error: str | None = None
        self.checked_at: float | None = None
        self.failed: str | None = None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="persia-serve-load")

    def _load(self, folder: str) -> Served:
        need, have = model_bytes(folder), available_memory_bytes()
        if need > have:
            raise ModelTooLargeError(f"{folder}: the model needs {need} bytes in memory, {have} bytes are available")
        return load_served(folder)

    async def check(self) -> bool:
        """Read the marker once and swap to the model it names if that is new; returns whether it swapped."""
        loop = asyncio.get_running_loop()
        try:
            marker = await loop.run_in_executor(self.pool, read_marker, self.location)
        except (OSError, ValueError) as e:
            self._failed(None, f"{io.join(self.location, BLESSED_MARKER)}: {e}")
            return False
        self.checked_at = time.time()
        if marker is None:
            return False
        folder = io.join(self.location, marker["model"])
        if folder == self.state["served"].folder:  # the marker names the served model again: no error is current
            self.error = self.failed = None
            return False
        if folder == self.failed:
            return False
        t0 = time.time()
        try:
            served = await loop.run_in_executor(self.pool, self._load, folder)
        except Exception as e:  # any failure to load leaves the old model serving
            self._failed(folder, f"{folder}: {type(e).__name__}: {e}")
            return False
        old = self.state["served"]
        self.state["served"] = served
        self.metrics.serving(served)
        self.metrics.swaps.labels("ok").inc()
        self.error = self.failed = None
        log.info("now serving %s (was %s; loaded in %.1f s)", served.version, old.version, time.time() - t0)
        return True

    def _failed(self, folder: str | None, message: str) -> None:
        self.failed, self.error = folder, message
        self.metrics.swaps.labels("failed").inc()
        log.error("follow: still serving %s: %s", self.state["served"].version, message)

    def status(self) -> dict:
        return {"location": self.location, "checked_at": self.checked_at, "error": self.error}


def _error(status: int, message: str):
    from aiohttp import web

    return web.json_response({"error": message}, status=status)


def make_app(
    served: Served,
    predict_route: str = DEFAULT_PREDICT_ROUTE,
    health_route: str = DEFAULT_HEALTH_ROUTE,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    threads: int = 2,
    follow: str = "",
    poll_s: float = 5.0,
    deltas: str = "",
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
):
    """The ``aiohttp.web.Application`` serving ``served`` on the given routes (see the module docstring), running
    up to ``threads`` requests' dense networks at once; with ``follow`` (a blessed-model location), swapping to
    each model newly blessed there (``Follower``, every ``poll_s`` seconds); with ``deltas`` (a training run's
    delta folder), applying its deltas to the served model (``serve.deltas.DeltaFeed``, every ``poll_s``
    seconds). A request body not all there ``body_timeout_s`` seconds after its headers gets 408."""
    from aiohttp import web

    metrics = Metrics()
    metrics.serving(served)
    state = {"served": served}
    # one torch thread in each worker: torch.set_num_threads holds for the thread that calls it (OpenMP), and a
    # new thread would otherwise run every operator on as many threads as cores, its helpers spinning between them
    pool = ThreadPoolExecutor(
        max(1, threads), thread_name_prefix="persia-serve-score", initializer=torch.set_num_threads, initargs=(1,)
    )

    def prepare(body: bytes) -> tuple[int, Any]:
        """A body -> ``(0, (model, its dense network's inputs))``, or ``(400, error)``."""
        try:
            request = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            return 400, {"error": f"the body is not JSON: {e}"}
        if not isinstance(request, dict) or "instances" not in request:
            return 400, {"error": 'the body must be a JSON object with "instances": [...]'}
        current: Served = state["served"]  # one model for the whole request, whatever a swap does meanwhile
        try:
            batch = current.encoder.batch(request["instances"])
        except InstanceError as e:
            return 400, {"error": str(e), "instance": e.index, "field": e.field}
        m = current.model
        with torch.no_grad():
            return 0, (current, readonly_inputs(m.embedding, m.layouts, m.wide, batch))

    @torch.no_grad()
    def forward(current: Served, inputs) -> bytes:
        """The response body of a request's prepared inputs (in a worker thread, or on the loop: ``INLINE_ROWS``)."""
        emb, values, term = inputs
        logits = current.model.dense(emb, values)
        probs = torch.sigmoid(logits if term is None else logits + term).numpy()
        metrics.instances.inc(len(probs))
        # float32 printed in the fewest digits that read back as the same float32 (orjson's numpy support)
        return orjson.dumps({"predictions": probs, "model_version": current.version}, option=orjson.OPT_SERIALIZE_NUMPY)

    def too_large() -> web.Response:
        metrics.requests.labels("predict", "413").inc()
        return _error(413, f"the request body exceeds {max_request_bytes} bytes; send fewer instances per request")

    async def predict(request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        if (request.content_length or 0) > max_request_bytes:  # declared: refused without waiting for the body
            return too_large()
        try:
            body = await asyncio.wait_for(request.read(), body_timeout_s)
        except web.HTTPRequestEntityTooLarge:
            return too_large()
        except TimeoutError:  # a client that sends part of a body and stalls holds no connection for good
            metrics.requests.labels("predict", "408").inc()
            return _error(408, f"the request body did not arrive within {body_timeout_s:g} s")
        except ConnectionResetError:  # the client left mid-body: nobody to answer, no server error to log
            metrics.requests.labels("predict", "499").inc()
            return web.Response(status=499)
        with metrics.in_flight.track_inprogress():
            status, payload = prepare(body)  # on the event loop: see the module docstring
            if not status:
                current, inputs = payload
                if len(inputs[0]) <= INLINE_ROWS:  # a forward shorter than the hand-off to a worker and back
                    text = forward(current, inputs)
                else:
                    text = await asyncio.get_running_loop().run_in_executor(pool, forward, current, inputs)
                status, payload = 200, (text, current.version)
        metrics.requests.labels("predict", str(status)).inc()
        if status == 200:
            metrics.latency.observe(time.perf_counter() - t0)
            text, version = payload
            return web.Response(body=text, content_type="application/json", headers={"X-Model-Version": version})
        return web.json_response(payload, status=status)

    follower = Follower(follow, state, metrics) if follow else None
    feed = DeltaFeed(deltas, state, load_served) if deltas else None
    feed_pool = ThreadPoolExecutor(1, thread_name_prefix="persia-serve-deltas") if feed else None

    async def apply_deltas() -> None:
        assert feed is not None and feed_pool is not None
        before = feed.total
        served = await asyncio.get_running_loop().run_in_executor(feed_pool, feed.check)
        if served is not None:
            state["served"] = served
            metrics.serving(served)
            metrics.deltas_applied.inc(feed.total - before)
            metrics.newest_delta_at = feed.applied.newest_at

    async def poll() -> None:
        while True:
            await asyncio.sleep(poll_s)
            if follower is not None:
                await follower.check()
            if feed is not None:
                await apply_deltas()

    async def health(_request: web.Request) -> web.Response:
        metrics.requests.labels("health", "200").inc()
        body: dict[str, Any] = {"status": "ok", "model_version": state["served"].version}
        if follower is not None:
            body["follow"] = follower.status()
        if feed is not None:
            body["deltas"] = feed.status()
        return web.json_response(body)

    async def metrics_route(_request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        resp = web.Response(body=metrics.text(state["served"]))
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return resp

    async def on_startup(app) -> None:
        if follower is not None or feed is not None:
            app["persia_follow_task"] = asyncio.get_running_loop().create_task(poll())

    async def on_cleanup(app) -> None:
        task = app.get("persia_follow_task")
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for p in (follower.pool if follower is not None else None, feed_pool, pool):
            if p is not None:
                p.shutdown(wait=True)

    app = web.Application(client_max_size=max_request_bytes)
    app.router.add_post(predict_route, predict)
    app.router.add_get(health_route, health)
    app.router.add_get("/metrics", metrics_route)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app["persia_state"], app["persia_metrics"], app["persia_follower"] = state, metrics, follower
    return app


def serve(
    model_dir: str,
    host: str = "127.0.0.1",
    port: int = 8080,
    predict_route: str = DEFAULT_PREDICT_ROUTE,
    health_route: str = DEFAULT_HEALTH_ROUTE,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    drain_s: float = 30.0,
    threads: int = 0,
    follow: bool = False,
    poll_s: float = 5.0,
    deltas: str = "",
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
) -> None:
    """Load ``model_dir`` and serve it on ``host:port`` until SIGTERM or SIGINT (then drain for up to
    ``drain_s`` seconds). ``threads``: requests whose dense network runs at once, each on one torch thread (0: the
    machine's cores, at most 4). ``follow``: ``model_dir`` is a blessed-model location whose newly blessed models are
    swapped in (``Follower``). ``deltas``: a training run's delta folder whose deltas are applied to the served
    model (``serve.deltas.DeltaFeed``). ``body_timeout_s``: a request body slower than this gets 408. Raises
    ``ModelTooLargeError`` (``check_memory``), ``FileNotFoundError`` / ``ValueError`` for a missing or bad model."""
    from aiohttp import web

    threads = threads or min(4, os.cpu_count() or 1)
    torch.set_num_threads(1)  # parallel across requests: one torch thread each
    if follow and not is_blessed_location(model_dir):
        raise ValueError(f"--follow {model_dir}: not a blessed-model location (no {BLESSED_MARKER})")
    if deltas and io.exists(deltas) and not io.isdir(deltas):
        raise ValueError(f"--deltas {deltas}: not a folder (a training run's delta_dir)")
    need = check_memory(model_dir)
    with torch.jit.optimized_execution(False):  # the traces without the profiling executor: see ``traced_dense``
        served = load_served(model_dir)
        gc.collect()
        gc.freeze()  # what start-up made lives as long as the server: the collector need not scan it on every pass
        log.info(
            "loaded %s (%s, %d bytes); starting on http://%s:%d: POST %s, GET %s, GET /metrics",
            served.folder,
            served.version,
            need,
            host,
            port,
            predict_route,
            health_route,
        )
        app = make_app(
            served,
            predict_route,
            health_route,
            max_request_bytes,
            threads,
            model_dir if follow else "",
            poll_s,
            deltas,
            body_timeout_s,
        )
        web.run_app(app, host=host, port=port, shutdown_timeout=drain_s, print=None, access_log=None)
    log.info("stopped: requests in flight answered, or cut %.0f s after the signal (drain_s)", drain_s)
