"""``persia serve --deltas``: the served model kept fresh from a training run's delta files (PERSIA's online
update, Lian et al., KDD 2022, Sec. 4.2; the files: ``persia_core.embedding.delta``).

A training run that warm-started from the served model writes, every ``delta_every_s`` seconds, the rows it changed
and the keys it evicted, per shard, under its ``delta_dir``; each delta names the model its run started from
(``base_model``: that model's ``model_store.manifest_digest``). Every poll, ``DeltaFeed`` applies to the served model
the deltas numbered after the last one it applied, shard by shard in order:

- only deltas whose ``base_model`` is the served model's digest (a run that warm-started from it); others wait,
  and the status says which model they need;
- in their numbering without a gap: a delta whose predecessor is not there yet waits for it (files copied to
  Cloud Storage may arrive out of order);
- never a delta marked superseded (``epochs: auto`` put an earlier epoch's model back; the rollback delta written
  then undoes any superseded one already applied);
- when the numbering went back (a new run in the same folder, or a retried one that rewrote deltas after its
  checkpoint), the deltas are applied again from the served model's own rows.

The rows are absolute values, so the result equals ``embedding.delta.load_with_deltas`` of the served model's shard
files. The embedding tables of each shard with new deltas are rebuilt beside the served ones (sized to the rows they
then hold), one shard's rows copied at a time (a shard without new deltas keeps its tables), and swapped in between
two requests (a request keeps the model it started with); the dense network is shared. These rows have not been
through the evaluate step's gate: serving them trades that for freshness, as PERSIA's online update does.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from persia_core import io
from persia_core.embedding import kernels as K
from persia_core.embedding.delta import apply_deltas, list_deltas, member, stacked, superseded_deltas
from persia_core.embedding.reference import LocalEmbedding, sized_tables
from persia_core.embedding.shard_file import ShardContents, read_shard_file
from persia_core.model_store import manifest_digest

log = logging.getLogger("persia.serve")


def warm_kernels(model) -> None:
    """Load now the compiled kernels that applying a delta to ``model``'s tables runs (from numba's cache, tens of
    ms each, holding the GIL), on empty tables of its config: not beside requests at the first delta."""
    cfg = model.embedding.config
    for t in sized_tables(cfg, {}, model.config.trainer.seed).values():
        state = t.state_dict()
        rows = np.zeros(0, dtype=np.int64)
        state = {k: stacked([(v, rows), (v, rows)]) for k, v in state.items()}
        member(np.zeros(1, dtype=np.uint64), np.zeros(1, dtype=np.uint64))
        K.newest_first(np.zeros(0, dtype=state["last_used"].dtype))
        t.load_state_dict(state)


@dataclass
class _Applied:
    """What the served model holds of a delta folder: per shard the last delta applied (number, file size)."""

    digest: str
    seq: list[int]
    size: list[int]
    newest_at: float | None = None
    waiting: str = ""
    error: str = ""


class DeltaFeed:
    """Applies the deltas under ``delta_dir`` to the model that ``state["served"]`` holds (a ``Served``);
    ``load(folder)`` loads a model as served (``server.load_served``).

    ``check()`` (called from one thread at a time) returns the new ``Served`` with the deltas applied since the
    last call, or None when none applies. A delta that cannot be read or applied leaves the served model as it
    was; ``status()["error"]`` says why, and it is tried again at the next check."""

    def __init__(self, delta_dir: str, state: dict, load: Callable[[str], Any], pace: float = 1.0):
        self.delta_dir, self.state, self.load, self.pace = delta_dir, state, load, pace
        self._restart(state["served"])
        warm_kernels(state["served"].model)
        self.total = 0  # delta files applied since start (a counter: never goes back, a restart included)

    @contextlib.contextmanager
    def _paced(self):
        """After a step of applying deltas, sleep ``pace`` times as long as it took (at most 1 s): the work then
        takes at most ``1 / (1 + pace)`` of a core, and the requests served beside it keep the rest."""
        t0 = time.perf_counter()
        yield
        time.sleep(min(1.0, self.pace * (time.perf_counter() - t0)))

    def _restart(self, served) -> None:
        """Start over on ``served`` (as loaded, without deltas). Only its folder and version are kept, not its
        rows: going back to them (a renumbered folder) loads it again, so no more than two models' rows are ever
        in memory (the served ones and those being built)."""
        self.base_folder, self.base_version = served.folder, served.version
        self.applied = self._nothing_applied(served)

    @staticmethod
    def _nothing_applied(served) -> _Applied:
        n = served.model.manifest.num_shards
        return _Applied(manifest_digest(served.folder), [0] * n, [0] * n)

    def check(self):
        """Apply what is new; see the class docstring. Returns a ``Served`` or None."""
        served = self.state["served"]
        if served.folder != self.base_folder:  # follow mode swapped to another model: start over on it
            self._restart(served)
        a = self.applied
        try:
            if io.exists(self.delta_dir) and not io.isdir(self.delta_dir):
                raise NotADirectoryError(f"{self.delta_dir} is not a folder")
            todo, gone, waiting = self._pending(a)
            if gone:
                log.info(
                    "%s no longer holds the deltas applied (%s; a new or retried run, or files removed): applying "
                    "its deltas again from %s's own rows",
                    self.delta_dir,
                    gone,
                    self.base_version,
                )
                served = self.load(self.base_folder)  # its rows are nobody's yet: the deltas go into them
                a = self._nothing_applied(served)
                todo, _, waiting = self._pending(a)
            a.waiting = waiting
            if any(todo):
                served = self._apply(served, todo, a, in_place=bool(gone))
            elif not gone:
                return None
        except Exception as e:  # an unreadable or refused delta leaves the served model as it was
            self.applied.error = f"{type(e).__name__}: {e}"
            log.error("deltas: still serving %s: %s", self.state["served"].version, self.applied.error)
            return None
        a.error = ""
        self.applied = a
        return served

    def _pending(self, a: _Applied) -> tuple[list[list[tuple[int, str, ShardContents]]], str, str]:
        """Per shard, the deltas to apply in order (number, path, the file read); what the folder no longer
        holds of those applied ("" when it holds them all); why deltas wait ("" when none does). A shard's list
        stops at a number missing before a later one (a delta not there yet), or at a delta of another run's
        base."""
        todo: list[list[tuple[int, str, ShardContents]]] = []
        gone, waiting = "", []
        for s in range(len(a.seq)):
            listed = list_deltas(self.delta_dir, s)
            paths = dict(listed)
            if a.seq[s] and (a.seq[s] not in paths or io.size(paths[a.seq[s]]) != a.size[s]):
                gone = f"shard {s}: delta {a.seq[s]} " + ("changed" if a.seq[s] in paths else "missing")
            superseded = superseded_deltas(self.delta_dir, s)
            mine: list[tuple[int, str, ShardContents]] = []
            expect = a.seq[s] + 1
            for seq, path in listed:
                if seq < expect:
                    continue
                if seq > expect:
                    waiting.append(f"shard {s}: delta {expect} is missing while {path} is there")
                    break
                expect += 1
                if seq in superseded:
                    continue
                with self._paced():
                    contents = read_shard_file(path, build_index=False)  # read once: its header here, its rows later
                header = (contents.server or {}).get("delta", {})
                base = str(header.get("base_model", ""))
                if base != a.digest:
                    started = f"from model {base}" if base else "cold"
                    waiting.append(f"{path} is of a run that started {started}, not from the served model {a.digest}")
                    break
                mine.append((seq, path, contents))
            todo.append(mine)
        return todo, gone, "; ".join(waiting)

    def _apply(self, served, todo: list[list[tuple[int, str, ShardContents]]], a: _Applied, in_place: bool = False):
        """A ``Served`` whose tables are ``served``'s with the deltas of ``todo`` applied (new tables in a copy of
        its embedding, or with ``in_place`` in ``served``'s own: a model no request uses yet); updates ``a``."""
        old: LocalEmbedding = served.model.embedding
        emb = old if in_place else copy.copy(old)  # a shard without new deltas keeps its tables (read-only)
        emb.shards = list(old.shards)
        for s, deltas in enumerate(todo):
            if not deltas:
                continue
            with self._paced():
                state = {name: t.state_dict() for name, t in old.shards[s].items()}  # one shard's rows at a time
            with self._paced():
                state = apply_deltas(state, [p for _, p, _ in deltas], [c for _, _, c in deltas])
            with self._paced():
                # sized to the rows they now hold, as the served model's own (LocalEmbedding.from_shard_files)
                rows = {name: len(sd["keys"]) for name, sd in state.items()}
                tables = sized_tables(old.config, rows, served.model.config.trainer.seed)
                for name, t in tables.items():
                    if name in state:
                        t.load_state_dict(state[name])
                    t.freeze()  # as the served model's own: the next deltas read its state without the lock
            emb.shards[s] = tables
            del state
        for s, deltas in enumerate(todo):
            if deltas:
                seq, path, last = deltas[-1]
                a.seq[s], a.size[s] = seq, io.size(path)
                at = ((last.server or {}).get("delta") or {}).get("at")
                if isinstance(at, (int, float)):
                    a.newest_at = max(a.newest_at or 0.0, float(at))
                self.total += len(deltas)
        model = copy.copy(served.model)
        model.embedding = emb
        version = f"{self.base_version}+deltas-{'.'.join(str(q) for q in a.seq)}"
        log.info("applied %d delta(s) from %s: now serving %s", sum(map(len, todo)), self.delta_dir, version)
        return replace(served, model=model, version=version, loaded_at=time.time())

    def status(self) -> dict:
        a = self.applied
        return {
            "dir": self.delta_dir,
            "applied": list(a.seq),
            "newest_delta_at": a.newest_at,
            "waiting": a.waiting or None,
            "error": a.error or None,
        }
