"""SIGTERM while the parameter servers write the final model: the step ends within its grace period, the previous
complete checkpoint stays usable, and no partial model is left in the output folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from support import tiny_config, write_dataset

from persia_core.checkpoints import MANIFEST, list_checkpoints
from persia_core.train.processes import descendants, process_state

GRACE_S = 30.0  # Kubernetes' default terminationGracePeriodSeconds: SIGKILL follows SIGTERM after it


def _roles(pid: int) -> dict[int, bytes]:
    out = {}
    for p in descendants(pid):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                out[p] = f.read()
        except OSError:
            continue
    return out


@pytest.mark.processes
def test_sigterm_during_the_final_dump_ends_the_step_in_its_grace_period_leaving_no_partial_model(tmp_path):
    # before: the launcher waited for the in-flight dump (up to its 30-minute deadline) before it stopped anything
    data = write_dataset(str(tmp_path / "data"), rows=192)
    model = str(tmp_path / "model")
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(tiny_config(num_workers=1, embedding_staleness=0, epochs=20).to_yaml())
    script = textwrap.dedent(
        f"""
        from persia_core.checkpoints import CheckpointSettings
        from persia_core.config import load_config
        from persia_core.train.launcher import train
        cfg = load_config({str(cfg_path)!r})
        train(cfg, {data!r}, {model!r}, checkpoint=CheckpointSettings(every_steps=20, keep=3))
        """
    )
    launcher = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    try:
        # the NN worker's end starts the final dump; a parameter server stopped at that moment makes it a slow one
        # (a dump of many GB, a slow disk): the launcher is then waiting on it when SIGTERM comes
        seen_worker, stopped = False, None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and launcher.poll() is None:
            roles = _roles(launcher.pid)
            workers = [p for p, c in roles.items() if b"persia_core.train.worker" in c]
            servers = [p for p, c in roles.items() if b"persia_core.ps.server" in c and b"--shard\x001\x00" in c]
            seen_worker = seen_worker or bool(workers)
            if seen_worker and not workers and servers:
                stopped = servers[0]
                os.kill(stopped, signal.SIGSTOP)
                break
            time.sleep(0.002)
        assert stopped is not None, "training ended before its final dump could be caught"
        time.sleep(1.0)  # the dump is under way: shard 0 written or writing, shard 1 waiting on its server
        os.kill(launcher.pid, signal.SIGTERM)
        termed = time.monotonic()
        try:
            launcher.wait(timeout=GRACE_S + 30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher was still running {GRACE_S + 30:.0f} s after SIGTERM")
        ended = time.monotonic() - termed
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for p in descendants(launcher.pid) if launcher.poll() is None else []:
            os.kill(p, signal.SIGKILL)
    err = launcher.stderr.read() if launcher.stderr else ""
    assert process_state(stopped) in ("", "Z"), "the stopped parameter server was left behind"
    # well within the grace period: stopping kills and reaps, it waits on no server (on main 21.6 s here: the
    # in-flight dump was waited for until the stopped server missed its keepalive pings; a server busy writing
    # many GB answers them, and was waited for to the end of its dump)
    assert ended < GRACE_S / 3, f"the step took {ended:.1f} s to end after SIGTERM; its stderr:\n{err[-2000:]}"
    assert launcher.returncode != 0
    # no partial model: no manifest, no shard file (or one half written), no dense weights or metrics
    left = sorted(
        os.path.relpath(os.path.join(d, f), model)
        for d, _, files in os.walk(model)
        for f in files
        if not os.path.relpath(d, model).startswith(("logs", "checkpoints"))
    )
    assert left == [], f"a partial model is left in {model}: {left}"
    assert os.listdir(os.path.join(model, "logs"))  # the logs, for the post-mortem
    # the previous complete checkpoint is usable: the run resumes from it and finishes
    done = [
        p for _, p in list_checkpoints(os.path.join(model, "checkpoints")) if os.path.exists(os.path.join(p, MANIFEST))
    ]
    assert done, "no complete checkpoint left"
    from persia_core.checkpoints import CheckpointSettings
    from persia_core.config import load_config
    from persia_core.train.launcher import train

    manifest = train(load_config(str(cfg_path)), data, model, checkpoint=CheckpointSettings(every_steps=20, keep=3))
    assert manifest["resumed_from"] == done[0]
    assert process_state(stopped) in ("", "Z"), "the stopped parameter server was left behind"
