"""``persia serve --deltas``: the served model kept fresh from a training run's delta files (PERSIA's online
update, Lian et al., KDD 2022, Sec. 4.2; the files: ``persia_core.embedding.delta``).

A training run that warm-started from the served model writes, every ``delta_every_s`` seconds, the rows it changed
and the keys it evicted, per shard, under its ``delta_dir``; each delta names the model its run started from
(``base_model``: that model's ``model_store.manifest_digest``). Every poll, ``DeltaFeed`` applies to the served model
the deltas numbered after the last one it applied, shard by shard in order:

- only deltas whose ``base_model`` is the served model's digest (a run that warm-started from it); others wait,
  and the status says which model they need;
- never a delta marked superseded (``epochs: auto`` put an earlier epoch's model back; the rollback delta written
  then undoes any superseded one already applied);
- when the numbering went back (a new run in the same folder, or a retried one that rewrote deltas after its
  checkpoint), the deltas are applied again from the served model's own rows.

The rows are absolute values, so the result equals ``embedding.delta.load_with_deltas`` of the served model's
shard files. The embedding tables are rebuilt beside the served ones, one shard's rows copied at a time, and
swapped in between two requests (a request keeps the model it started with); the dense network is shared. These
rows have not been through the evaluate step's gate: serving them trades that for freshness, as PERSIA's online
update does.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, replace

from persia_core import io
from persia_core.embedding.delta import apply_deltas, list_deltas, superseded_deltas
from persia_core.embedding.reference import LocalEmbedding
from persia_core.embedding.shard_file import read_shard_file
from persia_core.model_store import manifest_digest

log = logging.getLogger("persia.serve")


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
    """Applies the deltas under ``delta_dir`` to the model that ``state["served"]`` holds (a ``Served``).

    ``check()`` (called from one thread at a time) returns the new ``Served`` with the deltas applied since the
    last call, or None when none applies. A delta that cannot be read or applied leaves the served model as it
    was; ``status()["error"]`` says why, and it is tried again at the next check."""

    def __init__(self, delta_dir: str, state: dict):
        self.delta_dir, self.state = delta_dir, state
        self.base = state["served"]  # the model as loaded, without deltas: where a new numbering starts again
        self.applied = self._fresh(self.base)
        self.total = 0  # delta files applied since start (a counter: never goes back, a restart included)

    @staticmethod
    def _fresh(base) -> _Applied:
        n = base.model.manifest.num_shards
        return _Applied(manifest_digest(base.folder), [0] * n, [0] * n)

    def _restart(self, served) -> None:
        self.base = served
        self.applied = self._fresh(served)

    def check(self):
        """Apply what is new; see the class docstring. Returns a ``Served`` or None."""
        served = self.state["served"]
        if served.folder != self.base.folder:  # follow mode swapped to another model: start over on it
            self._restart(served)
        a = self.applied
        try:
            todo, restart = self._pending(a)
            if restart:
                log.info("deltas in %s were renumbered (a new or retried run): applying them again", self.delta_dir)
                served, a = self.base, self._fresh(self.base)
                todo, _ = self._pending(a)
            if not any(todo):
                if restart:
                    self.applied = a
                    return served
                return None
            new = self._apply(served, todo, a)
        except Exception as e:  # an unreadable or refused delta leaves the served model as it was
            self.applied.error = f"{type(e).__name__}: {e}"
            log.error("deltas: still serving %s: %s", served.version, self.applied.error)
            return None
        a.error = ""
        self.applied = a
        return new

    def _pending(self, a: _Applied) -> tuple[list[list[tuple[int, str, dict]]], bool]:
        """Per shard, the deltas to apply in order (number, path, its ``delta`` header) and whether the folder's
        numbering went back. Deltas of another run's base stop their shard's list there (``a.waiting``)."""
        todo: list[list[tuple[int, str, dict]]] = []
        restart = False
        a.waiting = ""
        for s in range(len(a.seq)):
            listed = list_deltas(self.delta_dir, s)
            paths = dict(listed)
            if a.seq[s] and (a.seq[s] not in paths or io.size(paths[a.seq[s]]) != a.size[s]):
                restart = True
            gone = superseded_deltas(self.delta_dir, s)
            mine: list[tuple[int, str, dict]] = []
            for seq, path in listed:
                if seq <= a.seq[s] or seq in gone:
                    continue
                header = (read_shard_file(path, build_index=False).server or {}).get("delta", {})
                base = str(header.get("base_model", ""))
                if base != a.digest:
                    a.waiting = (
                        f"{path} is of a run that started from model {base or '(a cold start)'}, not from the "
                        f"served model {a.digest}"
                    )
                    break
                mine.append((seq, path, header))
            todo.append(mine)
        return todo, restart

    def _apply(self, served, todo: list[list[tuple[int, str, dict]]], a: _Applied):
        """A ``Served`` whose tables are ``served``'s with the deltas of ``todo`` applied; updates ``a``."""
        old: LocalEmbedding = served.model.embedding
        emb = LocalEmbedding(old.config, old.num_shards, served.model.config.trainer.seed)
        for s, deltas in enumerate(todo):
            state = {name: t.state_dict() for name, t in old.shards[s].items()}  # one shard's rows at a time
            if deltas:
                state = apply_deltas(state, [p for _, p, _ in deltas])
            for name, t in emb.shards[s].items():
                if name in state:
                    t.load_state_dict(state[name])
            del state
        for s, deltas in enumerate(todo):
            if deltas:
                seq, path, header = deltas[-1]
                a.seq[s], a.size[s] = seq, io.size(path)
                at = header.get("at")
                if isinstance(at, (int, float)):
                    a.newest_at = max(a.newest_at or 0.0, float(at))
                self.total += len(deltas)
        model = copy.copy(served.model)
        model.embedding = emb
        version = f"{self.base.version}+deltas-{'.'.join(str(q) for q in a.seq)}"
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
