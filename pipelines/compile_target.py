"""The compile-time switch of a pipeline target: while a target is compiled, the pipeline body reads its settings."""

import contextlib
from collections.abc import Iterator
from typing import Generic, TypeVar

S = TypeVar("S")


class CompileTarget(Generic[S]):
    """Holds the settings of a target while it is compiled (``compiling_for``); ``current()`` is None otherwise."""

    def __init__(self) -> None:
        self._settings: S | None = None

    @contextlib.contextmanager
    def compiling_for(self, settings: S) -> Iterator[S]:
        """While active, ``current()`` returns ``settings`` (nested uses restore the outer one)."""
        old, self._settings = self._settings, settings
        try:
            yield settings
        finally:
            self._settings = old

    def current(self) -> S | None:
        """The settings of the compile in progress, or None."""
        return self._settings
