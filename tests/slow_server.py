"""Test helper: an in-process table whose pushes are applied late, as by a slow parameter server (kept apart from
``support``, which the TFRecord environment imports without the project's kernels)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from persia_core.embedding.reference import LocalEmbedding


class SlowPushes(LocalEmbedding):
    """An in-process table whose pushes are applied ``delay_s`` seconds after they are made (each in a thread of
    its own), as by a slow parameter server; ``applied``: the steps of the pushes applied, in that order."""

    def __init__(self, config, num_shards: int, delay_s: float, **kwargs):
        super().__init__(config, num_shards, **kwargs)
        self.delay_s = delay_s
        self.applied: list[int] = []

    def push(
        self,
        table,
        ids,
        grads,
        step=0,
        sync_workers=0,
        step_fraction=1.0,
        bounds=None,
        lr_scale=1.0,
        epochs_trained=1.0,
    ):
        fut: Future = Future()

        def later():
            time.sleep(self.delay_s)
            LocalEmbedding.push(
                self, table, ids, grads, bounds=bounds, lr_scale=lr_scale, epochs_trained=epochs_trained
            )
            self.applied.append(step)
            fut.set_result(0)

        threading.Thread(target=later, daemon=True).start()
        return fut
