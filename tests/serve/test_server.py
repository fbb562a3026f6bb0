"""``persia serve``: a real server process on 127.0.0.1 and a real HTTP client (``urllib``). Its predictions equal
``persia predict`` on the same rows; Vertex AI's environment variables pick the port, routes and model; bad
requests get 400/413 and crash nothing; ``/metrics`` counts what was served; SIGTERM drains a request in flight;
a model that does not fit twice in memory is refused; follow mode swaps to a newly blessed model without failing a
request and keeps serving when a blessed model cannot be loaded."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from persia_core.data.reader import ParquetExamples
from persia_core.embedding.reference import LocalEmbedding
from persia_core.evaluate.gate import bless
from persia_core.evaluate.predict import predict
from persia_core.evaluate.run import LoadedModel
from persia_core.hashing import feature_ids
from persia_core.model_store import BLESSED_MARKER, latest_blessed_model
from persia_core.serve.instances import InstanceEncoder
from persia_core.serve.server import INLINE_ROWS, ModelTooLargeError, check_memory, model_bytes, model_version
from persia_core.train.processes import free_port

pytestmark = pytest.mark.processes
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Server:
    """``python -m persia_core serve ARGS`` in a subprocess, waited for on its health route.

    The port (``port``, also in ``--port`` of ``args`` or ``AIP_HTTP_PORT`` of ``env``) was free a moment before;
    another test's process may take it meanwhile (parallel workers start gRPC servers): then a reply that is not
    HTTP/1 means "not up yet", and a server that could not bind is started again on a fresh port (``self.port``)."""

    def __init__(self, args: list[str], env: dict[str, str], port: int, health: str, log_path: str):
        self.log_path = log_path
        for attempt in range(3):
            self._start(args, env, port)
            up = self._wait(health)
            if up:
                return
            text = open(log_path, errors="replace").read()
            self.stop()
            if "address already in use" not in text.lower() or attempt == 2:
                raise AssertionError(f"the server did not come up: {text}")
            port = free_port()  # taken by another test's process: start again elsewhere
            args = [str(port) if i and args[i - 1] == "--port" else a for i, a in enumerate(args)]
            env = dict(env, AIP_HTTP_PORT=str(port)) if "AIP_HTTP_PORT" in env else env

    def _start(self, args: list[str], env: dict[str, str], port: int) -> None:
        self.port = port
        self.log = open(self.log_path, "wb")
        full_env = {**os.environ, "PYTHONPATH": ROOT, **env}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "persia_core", "serve", *args], env=full_env, stdout=self.log, stderr=self.log
        )

    def _wait(self, health: str) -> bool:
        deadline = time.time() + 60
        while True:
            try:
                status, _, _ = self.get(health)
                if status == 200:
                    return True
            except (OSError, http.client.HTTPException):  # not listening yet, or another process's listener
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                return False
            time.sleep(0.2)

    def url(self, route: str) -> str:
        return f"http://127.0.0.1:{self.port}{route}"

    def get(self, route: str) -> tuple[int, dict, bytes]:
        with urllib.request.urlopen(self.url(route), timeout=30) as r:
            return r.status, dict(r.headers), r.read()

    def post(self, route: str, body: bytes) -> tuple[int, dict, dict]:
        req = urllib.request.Request(self.url(route), data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, dict(r.headers), json.loads(r.read())
        except urllib.error.HTTPError as e:
            text = e.read()
            return e.code, dict(e.headers), json.loads(text) if text.startswith(b"{") else {"raw": text.decode()}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


ROWS = [  # tiny_config's layout: label, x, a, b, tags
    ["1", "0.5", "3", "17", "4"],
    ["0", "", "19", "", ""],
    ["1", "2.5", "7", "1", "9"],
    ["0", "-1", "2", "44", "0"],
    ["1", "3", "unseen-value", "5", "7"],
]


def _as_instances(rows: list[list[str]]) -> list[dict]:
    """The rows as JSON instances, in every form a client may send: strings, numbers, null, absent keys; no
    label."""
    out = []
    for i, (_label, x, a, b, tags) in enumerate(rows):
        inst: dict = {"x": float(x) if "." in x else int(x)} if x else {"x": None}
        inst["a"] = int(a) if a.isdigit() and i % 2 else a
        if b:
            inst["b"] = b
        if tags:
            inst["tags"] = tags
        out.append(inst)
    return out


@pytest.fixture(scope="module")
def server(trained, tmp_path_factory):
    """The trained model served as Vertex AI would start the image: everything from the AIP_* variables."""
    model, _ = trained
    port = free_port()
    env = {
        "AIP_HTTP_PORT": str(port),
        "AIP_PREDICT_ROUTE": "/v1/endpoints/e1/deployedModels/m1:predict",
        "AIP_HEALTH_ROUTE": "/v1/endpoints/e1/deployedModels/m1",
        "AIP_STORAGE_URI": model,
    }
    log = str(tmp_path_factory.mktemp("serve") / "serve.log")
    s = Server(["--max-request-bytes", "4096", "--body-timeout-seconds", "2"], env, port, env["AIP_HEALTH_ROUTE"], log)
    yield s, env
    s.stop()


def test_served_predictions_equal_persia_predict_on_the_same_rows(server, trained, tmp_path):
    s, env = server
    model, _ = trained
    raw = tmp_path / "rows.tsv"
    raw.write_text("".join("\t".join(r) + "\n" for r in ROWS))
    expected = predict(model, str(raw), str(tmp_path / "p.csv"))["probability"]

    assert len(ROWS) <= INLINE_ROWS < 3 * len(ROWS)
    for copies in (1, 3):  # 5 instances: the dense step on the event loop; 15: in a worker thread
        instances = _as_instances(ROWS) * copies
        status, headers, body = s.post(env["AIP_PREDICT_ROUTE"], json.dumps({"instances": instances}).encode())
        assert status == 200, body
        got = np.array(body["predictions"], dtype=np.float64)
        assert got.shape == (len(ROWS) * copies,)
        np.testing.assert_allclose(got, np.tile(expected.astype(np.float64), copies), rtol=0, atol=1e-6)
        assert body["model_version"] == headers["X-Model-Version"] == model_version(model)

    status, _, raw_health = s.get(env["AIP_HEALTH_ROUTE"])
    assert status == 200 and json.loads(raw_health) == {"status": "ok", "model_version": model_version(model)}


def test_preprocessed_feature_rows_score_like_the_eval_split(trained):
    """The MovieLens-form instance (slot_<name> feature IDs, dense values) equals scoring the Parquet rows."""
    model_dir, data = trained
    model = LoadedModel(model_dir)
    examples = ParquetExamples([os.path.join(data, "eval", "eval-00000-of-00001.parquet")], model.slots, 1)
    rows = np.arange(40)
    expected = model.predict(examples.batch(rows))
    instances = []
    for r in rows:
        inst = {"dense": [float(examples.dense[r, 0])]}
        for s in model.slots:
            values, offsets = examples.ids[s]
            inst[f"slot_{s}"] = [int(v) for v in values[offsets[r] : offsets[r + 1]]]
        instances.append(inst)
    enc = InstanceEncoder(model.config, model.slots, 1)
    assert np.array_equal(model.predict(enc.features_batch(instances)), expected)
    assert np.isfinite(model.predict(enc.batch([enc.example()]))).all()  # the warm-up instance of its layout
    # a Parquet row as it is (its label, timestamp and source ignored: persia predict's input rows carry a source,
    # refused before, as a fresh-user trial found); null, [] and absent are the same empty slot
    as_stored = [{**inst, "label": 1.0, "ts": 12345, "source": "ratings.csv:7"} for inst in instances]
    assert np.array_equal(model.predict(enc.features_batch(as_stored)), expected)
    empty = [{**instances[0], "slot_a": []}, {**instances[0], "slot_a": None}, {"dense": instances[0]["dense"]}]
    empty_preds = model.predict(enc.features_batch(empty))
    assert empty_preds[0] == empty_preds[1] and np.isfinite(empty_preds).all()
    for bad in ([-1], [1.5], [True], [1 << 64], "7"):
        with pytest.raises(ValueError, match=r"instance 1, field 'slot_a'.*feature IDs"):
            enc.features_batch([instances[0], {**instances[1], "slot_a": bad}])
    for bad_dense in ([1.0, 2.0], [True], ["1"], 1.0):  # a JSON true was read as 1 before
        with pytest.raises(ValueError, match=r"instance 0, field 'dense': expected a list of 1 finite numbers"):
            enc.features_batch([{"dense": bad_dense}])
    for big in (1e300, -3.5e38):  # finite as JSON, inf as the float32 the model takes: 400, not a null prediction
        with pytest.raises(ValueError, match=r"instance 1, field 'dense': a value beyond float32 range"):
            enc.features_batch([instances[0], {**instances[1], "dense": [big]}])


def _still_answers(s: Server, env: dict[str, str]) -> None:
    """The server is alive and scores a good request after what a test sent it."""
    ok, _, good = s.post(env["AIP_PREDICT_ROUTE"], b'{"instances": [{"a": "3"}]}')
    assert ok == 200 and len(good["predictions"]) == 1
    assert s.proc.poll() is None


@pytest.mark.parametrize(
    "body,status,match",
    [
        (b"not json", 400, "not JSON"),
        (b'{"rows": []}', 400, '"instances"'),
        (b'{"instances": []}', 400, "instances: 'instances' must be a non-empty JSON array"),
        (b'{"instances": {"x": 1}}', 400, "instances: 'instances' must be a non-empty JSON array"),
        (b'{"instances": [{"x": 1}, 7]}', 400, "instance 1: expected a JSON object"),
        (b'{"instances": [{"x": 1}, {"a": "3", "zz": 1}]}', 400, "instance 1, field 'zz': not a column"),
        (b'{"instances": [{"x": "abc"}]}', 400, "instance 0, field 'x': unparsable number"),
        (b'{"instances": [{"x": 1, "a": true}]}', 400, "instance 0, field 'a': a boolean"),
        (b'{"instances": [{"a": {"nested": 1}}]}', 400, "instance 0, field 'a': expected a string"),
        (b'{"instances": [{"x": 1}, {"x": 2}, {"x": "1e999"}]}', 400, "instance 2, field 'x': unparsable number"),
        (b'{"instances": [{"x": 1}, {"x": "7", "label": "2"}]}', 400, "instance 1, field 'label': label not 0/1"),
        (json.dumps({"instances": [{"a": "3"}] * 400}).encode(), 413, "exceeds 4096 bytes"),
    ],
)
def test_bad_requests_get_400_or_413_naming_the_instance_and_field_and_crash_nothing(server, body, status, match):
    s, env = server
    got, _, payload = s.post(env["AIP_PREDICT_ROUTE"], body)
    assert got == status, payload
    assert match in payload["error"], payload
    _still_answers(s, env)


def test_a_declared_oversized_body_gets_413_without_waiting_for_it(server):
    s, env = server
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=10)
    try:
        conn.putrequest("POST", env["AIP_PREDICT_ROUTE"])
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", "9000000")
        conn.endheaders(b'{"instances": [')  # the rest never comes: the reply must not wait for it
        r = conn.getresponse()
        assert r.status == 413 and "exceeds 4096 bytes" in json.loads(r.read())["error"]
    finally:
        conn.close()
    _still_answers(s, env)


def test_a_body_that_stalls_mid_way_gets_408_and_frees_its_connection(server):
    # found by a fresh-user trial: a client that sent half a body and stopped was held open for over 90 s
    s, env = server
    with socket.create_connection(("127.0.0.1", s.port), timeout=15) as sock:
        head = f"POST {env['AIP_PREDICT_ROUTE']} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
        t0 = time.time()
        sock.sendall(head.encode() + b'{"instances": [')
        reply = sock.recv(4096).decode()
    assert reply.startswith("HTTP/1.1 408") and "did not arrive within 2 s" in reply, reply
    assert 1.5 < time.time() - t0 < 10
    _still_answers(s, env)


def test_a_client_that_leaves_mid_body_is_counted_not_logged_as_a_server_error(server):
    s, env = server
    start = os.path.getsize(s.log_path)  # the module's server: its log holds earlier tests' lines
    with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
        head = f"POST {env['AIP_PREDICT_ROUTE']} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
        sock.sendall(head.encode() + b'{"instances": [')
    deadline = time.time() + 10
    while _metrics(s).get('persia_serve_requests_total{route="predict",status="499"}', 0.0) < 1:
        assert time.time() < deadline, "the request left mid-body was not counted"
        time.sleep(0.1)
    with open(s.log_path, errors="replace") as f:
        f.seek(start)
        log_text = f.read()
    assert "Traceback" not in log_text and "Error handling request" not in log_text, log_text[-2000:]
    _still_answers(s, env)


def _metrics(s: Server) -> dict[str, float]:
    """The server's /metrics as ``{sample name with labels: value}`` (Prometheus text format)."""
    status, headers, text = s.get("/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    out = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _metric(s: Server, name: str) -> float:
    return _metrics(s)[name]


def test_metrics_count_requests_instances_and_name_the_model(server, trained):
    s, env = server
    model, _ = trained

    before = _metrics(s)
    for n in (1, 3, 2):
        assert s.post(env["AIP_PREDICT_ROUTE"], json.dumps({"instances": [{"a": "1"}] * n}).encode())[0] == 200
    assert s.post(env["AIP_PREDICT_ROUTE"], b"nope")[0] == 400
    after = _metrics(s)
    ok = 'persia_serve_requests_total{route="predict",status="200"}'
    bad = 'persia_serve_requests_total{route="predict",status="400"}'
    assert after[ok] - before.get(ok, 0) == 3
    assert after[bad] - before.get(bad, 0) == 1
    assert after["persia_serve_instances_total"] - before.get("persia_serve_instances_total", 0) == 6
    assert after["persia_serve_request_seconds_count"] - before.get("persia_serve_request_seconds_count", 0) == 3
    assert after[f'persia_serve_model_info{{model_version="{model_version(model)}"}}'] == 1
    assert 0 <= after["persia_serve_model_age_seconds"] < 600


def test_sigterm_lets_a_request_in_flight_finish_then_exits(trained, tmp_path):
    """The request is in flight for sure: SIGTERM comes once /metrics counts it as read and not answered."""
    model, _ = trained
    port = free_port()
    s = Server(["--model", model, "--port", str(port)], {}, port, "/health", str(tmp_path / "serve.log"))
    n = 100_000
    body = json.dumps({"instances": [{"x": i % 7, "a": str(i % 20), "b": str(i % 50)} for i in range(n)]}).encode()
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(reply=s.post("/predict", body)))
    try:
        t.start()
        deadline = time.time() + 30
        while _metric(s, "persia_serve_requests_in_flight") < 1:
            assert time.time() < deadline and t.is_alive(), "the request was never in flight"
            time.sleep(0.01)
        s.proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert s.proc.wait(60) == 0, open(tmp_path / "serve.log").read()
    finally:
        s.stop()
    status, _, payload = result["reply"]
    assert status == 200 and len(payload["predictions"]) == n
    with pytest.raises(OSError):
        s.get("/health")  # no longer listening


def test_a_model_that_does_not_fit_twice_in_memory_is_refused(trained):
    model, _ = trained
    with open(os.path.join(model, "manifest.json")) as f:
        manifest = json.load(f)
    files = [manifest["dense_file"], *manifest["shard_files"]]
    need = sum(os.path.getsize(os.path.join(model, f)) for f in files)
    assert model_bytes(model) == need > 0
    assert check_memory(model, available=2 * need) == need
    with pytest.raises(ModelTooLargeError, match=rf"needs {need} bytes .*\({2 * need} bytes\).*{2 * need - 1} bytes"):
        check_memory(model, available=2 * need - 1)


def test_feature_ids_of_a_served_row_are_the_preprocessed_ones(trained):
    """A JSON number is the text the raw file would hold: 3 and "3" are the same feature ID, 3.0 is not."""
    model_dir, _ = trained
    model = LoadedModel(model_dir)
    enc = InstanceEncoder(model.config, model.slots, 1)
    b = enc.batch([{"a": 3}, {"a": "3"}, {"a": 3.0}])
    values, offsets = b.ids.slot("a")
    assert [int(v) for v in values] == [*feature_ids("a", ["3"]) * 2, *feature_ids("a", ["3.0"])]
    assert list(offsets) == [0, 1, 2, 3]


def _variant(model: str, out: str, scale: float | None) -> str:
    """A copy of the Model ``model`` in ``out`` whose dense weights are scaled by ``scale`` (other predictions),
    or, for None, whose dense file is cut short (a model that cannot be loaded)."""
    shutil.copytree(model, out)
    path = os.path.join(out, "dense.pt")
    if scale is None:
        with open(path, "r+b") as f:
            f.truncate(100)
        return out
    state = torch.load(path, weights_only=True)
    torch.save({k: v * scale if v.is_floating_point() else v for k, v in state.items()}, path)
    return out


def test_follow_mode_swaps_to_a_newly_blessed_model_without_failing_a_request(trained, tmp_path):
    model, _ = trained
    blessed = str(tmp_path / "blessed")
    bless(model, {"auc": 0.5}, blessed)
    first = model_version(latest_blessed_model(blessed))
    port = free_port()
    args = ["--follow", blessed, "--poll-seconds", "0.2", "--port", str(port)]
    s = Server(args, {}, port, "/health", str(tmp_path / "serve.log"))
    body = json.dumps({"instances": [{"x": 0.5, "a": "3", "b": "17"}]}).encode()
    replies: list[tuple[int, str, float]] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            status, _, payload = s.post("/predict", body)
            replies.append((status, payload.get("model_version", ""), (payload.get("predictions") or [None])[0]))

    t = threading.Thread(target=client)
    try:
        t.start()
        while len(replies) < 20:
            time.sleep(0.05)
        other = _variant(model, str(tmp_path / "other"), 0.5)
        bless(other, {"auc": 0.6}, blessed)
        served_folder = latest_blessed_model(blessed)
        second = model_version(served_folder)
        deadline = time.time() + 10
        while not replies or replies[-1][1] != second:
            assert time.time() < deadline, f"still serving {replies[-1][1]}: {open(tmp_path / 'serve.log').read()}"
            time.sleep(0.05)
        n = len(replies)
        while len(replies) < n + 20:
            time.sleep(0.05)

        # a newly blessed model that cannot be loaded: the last good one keeps serving, health says why
        broken = _variant(model, str(tmp_path / "broken"), None)
        bless(broken, {"auc": 0.7}, blessed)
        bad = latest_blessed_model(blessed)
        deadline = time.time() + 10
        while not (health := json.loads(s.get("/health")[2]))["follow"]["error"]:
            assert time.time() < deadline, "the broken model was never tried"
            time.sleep(0.05)
        n = len(replies)
        while len(replies) < n + 20:
            time.sleep(0.05)
        # the marker rolled back to the served model: the broken one is no longer blessed, so no error is current
        marker = os.path.join(blessed, BLESSED_MARKER)
        with open(marker + ".tmp", "w") as f:
            json.dump({**json.load(open(marker)), "model": os.path.relpath(served_folder, blessed)}, f)
        os.replace(marker + ".tmp", marker)
        cleared = _wait_health(s, lambda h: h["follow"]["error"] is None, "the error of the rolled-back model")
        swaps = (
            _metric(s, 'persia_serve_model_swaps_total{result="ok"}'),
            _metric(s, 'persia_serve_model_swaps_total{result="failed"}'),
        )
    finally:
        stop.set()
        t.join(30)
        s.stop()
    assert all(r[0] == 200 for r in replies), [r for r in replies if r[0] != 200][:3]
    versions = [r[1] for r in replies]
    k = versions.index(second)
    assert set(versions[:k]) == {first} and set(versions[k:]) == {second}  # one swap, never back
    expected = {}
    for version, folder in ((first, model), (second, other)):
        m = LoadedModel(folder)
        expected[version] = float(
            m.predict(InstanceEncoder(m.config, m.slots, 1).batch(json.loads(body)["instances"]))[0]
        )
    assert expected[first] != expected[second]
    assert all(abs(p - expected[v]) <= 1e-6 for _, v, p in replies)
    assert health["model_version"] == second and bad in health["follow"]["error"]
    assert cleared["model_version"] == second  # no swap back and forth: the served model was named again
    assert swaps == (1, 1)


def _wait_health(s: Server, done, what: str, timeout: float = 30.0) -> dict:
    deadline = time.time() + timeout
    while not done(health := json.loads(s.get("/health")[2])):
        assert time.time() < deadline, f"{what}: {health}"
        time.sleep(0.1)
    return health


def test_deltas_of_a_run_warm_started_from_the_served_model_are_applied_and_others_wait(trained, tmp_path):
    from persia_core.embedding.delta import list_deltas
    from persia_core.embedding.plan import init_shards
    from persia_core.model_store import manifest_digest, read_manifest
    from persia_core.train.launcher import train
    from tests.support import tiny_config

    model, data = trained
    blessed, deltas = str(tmp_path / "blessed"), str(tmp_path / "deltas")
    bless(model, {"auc": 0.5}, blessed)
    served = latest_blessed_model(blessed)
    base_version = model_version(served)
    port = free_port()
    args = ["--model", blessed, "--deltas", deltas, "--poll-seconds", "0.1", "--port", str(port)]
    s = Server(args, {}, port, "/health", str(tmp_path / "serve.log"))
    instances = _as_instances(ROWS)
    body = json.dumps({"instances": instances}).encode()

    def run(name: str, warm_start_from: str) -> str:
        cfg = tiny_config(epochs=2)
        init, out = str(tmp_path / f"init-{name}"), str(tmp_path / f"model-{name}")
        init_shards(cfg, data, init, warm_start_from=warm_start_from)
        train(
            cfg, data, out, init_dir=init, work_dir=str(tmp_path / f"work-{name}"), delta_every_s=0.05, delta_dir=deltas
        )
        return out

    try:
        _, _, before = s.post("/predict", body)
        assert before["model_version"] == base_version
        # a run that warm-started from the served model: its deltas are applied, the last one written as its
        # servers stopped, so the served rows end as that run's Model's rows (the dense network stays the served one)
        warm = run("warm", blessed)
        last = [max(q for q, _ in list_deltas(deltas, sh)) for sh in range(2)]
        health = _wait_health(s, lambda h: h["deltas"]["applied"] == last, "the deltas were not all applied")
        _, headers, after = s.post("/predict", body)
        age = _metric(s, "persia_serve_delta_age_seconds")
        applied = _metric(s, "persia_serve_deltas_applied_total")

        # a new cold-started run in the same folder: renumbered deltas of another base; the server goes back to
        # the served model's own rows and waits
        run("cold", "")
        cold = _wait_health(s, lambda h: h["deltas"]["waiting"] is not None, "the cold run's deltas were applied")
        _, _, back = s.post("/predict", body)
    finally:
        s.stop()

    reference = LoadedModel(served)  # the served dense network on the warm run's final rows, from its Model files
    folder, manifest = read_manifest(warm)
    paths = [os.path.join(folder, f) for f in manifest.shard_files]
    reference.embedding = LocalEmbedding.from_shard_files(reference.config.embedding, paths)
    expected = reference.predict(InstanceEncoder(reference.config, reference.slots, 1).batch(instances))
    assert after["model_version"] == headers["X-Model-Version"] == f"{base_version}+deltas-{last[0]}.{last[1]}"
    np.testing.assert_allclose(after["predictions"], expected.astype(np.float64), rtol=0, atol=1e-6)
    assert not np.allclose(after["predictions"], before["predictions"], rtol=0, atol=1e-6)
    assert health["deltas"]["error"] is None and 0 <= age < 60 and applied == sum(last)
    assert manifest_digest(served) in cold["deltas"]["waiting"] and "started cold" in cold["deltas"]["waiting"]
    assert back["model_version"] == base_version
    np.testing.assert_allclose(back["predictions"], before["predictions"], rtol=0, atol=1e-6)
