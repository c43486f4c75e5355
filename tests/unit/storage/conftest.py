"""Fixtures of the storage tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fsspec.implementations.memory import MemoryFileSystem


@pytest.fixture
def memfs() -> Iterator[MemoryFileSystem]:
    """An empty in-memory filesystem (its store is process-global: emptied, then restored)."""
    saved_store, saved_dirs = dict(MemoryFileSystem.store), list(MemoryFileSystem.pseudo_dirs)
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]
    try:
        yield MemoryFileSystem()
    finally:
        MemoryFileSystem.store.clear()
        MemoryFileSystem.store.update(saved_store)
        MemoryFileSystem.pseudo_dirs[:] = saved_dirs
