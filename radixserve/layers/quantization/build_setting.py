"""A setting the linear layers read while a model is built (which quantisation their weights
take), scoped by a context manager so nested builds restore the outer one."""
from __future__ import annotations

import contextlib
from typing import Generic, Iterator, TypeVar

T = TypeVar("T")


class BuildSetting(Generic[T]):
    def __init__(self) -> None:
        self._stack: list[T | None] = [None]

    @contextlib.contextmanager
    def use(self, value: T | None) -> Iterator[None]:
        """Layers built inside take `value`."""
        self._stack.append(value)
        try:
            yield
        finally:
            self._stack.pop()

    def current(self) -> T | None:
        return self._stack[-1]
