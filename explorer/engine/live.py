"""Live, read-only views of a registry dict: what the menus, the validators and argparse's ``choices`` read, so that
a name registered at run time (a plugin's method, verifier or stop policy) is seen everywhere at once. Plain Python.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence


class LiveMapping(Mapping):
    """``{name: value(entry)}`` over ``source``'s entries that ``keep``, after the entries of ``first``; read at each
    access, never written through."""

    def __init__(self, source: dict, value: Callable = lambda e: e, keep: Callable | None = None,
                 first: Mapping | None = None):
        self._source, self._value, self._keep, self._first = source, value, keep or (lambda e: True), dict(first or {})

    def __getitem__(self, name):
        if name in self._first:
            return self._first[name]
        entry = self._source[name]
        if not self._keep(entry):
            raise KeyError(name)
        return self._value(entry)

    def __iter__(self) -> Iterator[str]:
        yield from self._first
        yield from (n for n, e in list(self._source.items()) if self._keep(e) and n not in self._first)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return repr(dict(self))


class LiveNames(Sequence):
    """The names of ``source``'s entries that ``keep``, in registration order: a live tuple (``+`` with a tuple
    gives a tuple; ``index``, ``in`` and equality with a tuple work as on a tuple)."""

    def __init__(self, source: dict, keep: Callable | None = None):
        self._source, self._keep = source, keep or (lambda e: True)

    def _names(self) -> tuple[str, ...]:
        return tuple(n for n, e in list(self._source.items()) if self._keep(e))

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name) -> bool:
        return name in self._names()

    def __add__(self, other):
        return self._names() + other if isinstance(other, tuple) else NotImplemented

    def __radd__(self, other):
        return other + self._names() if isinstance(other, tuple) else NotImplemented

    def __eq__(self, other) -> bool:
        return self._names() == (tuple(other) if isinstance(other, (tuple, LiveNames)) else other)

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self._names())
