"""The filesystem wrapper every ftjob filesystem extends (ftjob.storage.wrapper): each operation
reaches the inner filesystem as it implements it, exclusive creates wherever the backend allows,
write handles that publish only on close. Without network or sleeping."""

from __future__ import annotations

import errno
import gc
import os
import threading
from typing import Any

import pytest
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from ftjob.config import RetryConfig
from ftjob.storage.fs import (
    build_filesystem,
)
from ftjob.storage.wrapper import exclusive_create_guarantee
from tests.support.storage import (
    FakeGCSFileSystem,
    FakeTime,
    ScriptedFileSystem,
    retrying,
)


def test_every_operation_reaches_the_inner_filesystem_as_it_implements_it(
    memfs: MemoryFileSystem, tmp_path: Any
) -> None:
    scripted = ScriptedFileSystem(memfs, {})
    fs = retrying(scripted, FakeTime())
    local = tmp_path / "local.bin"
    local.write_bytes(b"local")
    fs.makedirs("/ops/dir", exist_ok=True)
    fs.mkdir("/ops/dir2")
    fs.pipe_file("/ops/dir/a", b"A")
    fs.put_file(str(local), "/ops/dir/b")
    assert fs.cat_file("/ops/dir/a") == b"A"
    fs.get_file("/ops/dir/b", str(tmp_path / "back.bin"))
    assert (tmp_path / "back.bin").read_bytes() == b"local"
    assert sorted(fs.ls("/ops/dir", detail=False)) == ["/ops/dir/a", "/ops/dir/b"]
    assert fs.info("/ops/dir/a")["size"] == 1
    assert sorted(fs.find("/ops")) == ["/ops/dir/a", "/ops/dir/b"]
    fs.cp_file("/ops/dir/a", "/ops/dir/c")
    fs.copy("/ops/dir/c", "/ops/dir/d")
    fs.mv("/ops/dir/d", "/ops/dir/e")
    fs.rm_file("/ops/dir/c")
    fs.rm("/ops/dir/e")
    fs.rmdir("/ops/dir2")
    assert fs.exists("/ops/dir/a") and not fs.exists("/ops/dir/c")
    assert memfs.cat_file("/ops/dir/a") == b"A" and not memfs.exists("/ops/dir/e")
    seen = {op for op, _ in scripted.calls}
    assert seen >= {"pipe_file", "put_file", "cat_file", "get_file", "ls", "info", "mkdir"}
    assert seen >= {"makedirs", "cp_file", "rm_file", "rmdir"}
    # What the memory filesystem implements itself arrives as itself; copy and mv, which it
    # inherits from fsspec, arrive as the requests fsspec makes them of.
    assert seen >= {"find", "rm"} and not seen & {"copy", "mv"}
    assert ("cp_file", "/ops/dir/c") in scripted.calls  # the copy
    assert ("put_file", "/ops/dir/b") in scripted.calls  # the storage path, not the local one


def test_operations_take_their_paths_by_keyword(memfs: MemoryFileSystem, tmp_path: Any) -> None:
    scripted = ScriptedFileSystem(memfs, {})
    fs = retrying(scripted, FakeTime())
    local = tmp_path / "local.bin"
    local.write_bytes(b"local")
    fs.pipe_file(path="/kw/a", value=b"A")
    fs.put_file(lpath=str(local), rpath="/kw/b")
    assert fs.cat_file(path="/kw/a") == b"A"
    fs.get_file(rpath="/kw/b", lpath=str(tmp_path / "back.bin"))
    assert (tmp_path / "back.bin").read_bytes() == b"local"
    assert fs.info(path="/kw/a")["size"] == 1
    fs.copy(path1="/kw/a", path2="/kw/c")
    fs.copy(path1=["/kw/a", "/kw/b"], path2=["/kw/d", "/kw/e"])
    assert fs.cat(path="/kw/e") == b"local"
    fs.rm_file(path="/kw/c")
    assert sorted(memfs.find("/kw")) == ["/kw/a", "/kw/b", "/kw/d", "/kw/e"]
    # Each request names its storage path, however it was passed.
    assert ("put_file", "/kw/b") in scripted.calls and ("get_file", "/kw/b") in scripted.calls
    assert ("cp_file", "/kw/a") in scripted.calls and ("rm_file", "/kw/c") in scripted.calls


def test_what_the_inner_filesystem_implements_is_what_answers(tmp_path: Any) -> None:
    local = LocalFileSystem()
    fs = retrying(local, FakeTime())
    path = str(tmp_path / "run" / "lease.json")
    fs.makedirs(str(tmp_path / "run"), exist_ok=True)
    fs.pipe_file(path, b"0123456789")
    assert fs.modified(path) == local.modified(path)  # the run lease reads the store's clock
    assert fs.created(path) == local.created(path)
    assert fs.size(path) == 10 and fs.sizes([path]) == [10]
    assert fs.tail(path, 3) == b"789" and fs.head(path, 2) == b"01"
    assert fs.read_block(path, 2, 3) == b"234"
    assert fs.cat_ranges([path, path], [0, 5], [2, 7]) == [b"01", b"56"]
    assert fs.isfile(path) and fs.isdir(str(tmp_path / "run")) and fs.lexists(path)
    assert fs.du(str(tmp_path / "run")) == local.du(str(tmp_path / "run"))
    assert fs.glob(str(tmp_path / "run" / "*.json")) == [path]
    # touch(truncate=False) keeps an existing file (fsspec's generic touch refuses to)
    fs.touch(path, truncate=False)
    assert local.cat_file(path) == b"0123456789"
    assert fs.ukey(path) == local.ukey(path) and fs.checksum(path) == local.checksum(path)


class RacingLocalFileSystem(LocalFileSystem):
    """Another driver creates each missing path (exclusively, and so wins it) just after it
    was checked for: a create made of a check, then a write, overwrites the winner's file."""

    cachable = False

    def __init__(self) -> None:
        super().__init__()
        self.their_wins: list[str] = []

    def exists(self, path: str, **kwargs: Any) -> bool:
        found = super().exists(path)
        if not found:
            with open(self._strip_protocol(path), "xb") as f:
                f.write(b"theirs")
            self.their_wins.append(path)
        return found


def test_exclusive_create_on_local_disk_has_one_winner_without_a_check(tmp_path: Any) -> None:
    racing = RacingLocalFileSystem()
    fs = retrying(racing, FakeTime())
    (tmp_path / "lease").mkdir()
    path = str(tmp_path / "lease" / "000000001.json")
    try:
        fs.pipe_file(path, b"ours", mode="create")
        our_wins = [path]
    except FileExistsError:
        our_wins = []
    assert len(our_wins + racing.their_wins) == 1
    winner = b"ours" if our_wins else b"theirs"
    assert (tmp_path / "lease" / "000000001.json").read_bytes() == winner
    assert sorted(p.name for p in (tmp_path / "lease").iterdir()) == ["000000001.json"]


def test_exclusive_create_without_hard_links_is_still_exclusive(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(src: str, dst: str) -> None:  # a FUSE mount of a bucket, say
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    fs = retrying(LocalFileSystem(), FakeTime())
    path = str(tmp_path / "000000001.json")
    fs.pipe_file(path, b"first", mode="create")
    with pytest.raises(FileExistsError):
        fs.pipe_file(path, b"second", mode="create")
    assert (tmp_path / "000000001.json").read_bytes() == b"first"
    assert [p.name for p in tmp_path.iterdir()] == ["000000001.json"]


@pytest.mark.parametrize("backend", ["local", "memory"])
def test_one_of_many_racing_creates_wins(
    backend: str, tmp_path: Any, memfs: MemoryFileSystem
) -> None:
    inner: AbstractFileSystem = LocalFileSystem() if backend == "local" else memfs
    root = str(tmp_path) if backend == "local" else "/race"
    inner.makedirs(root, exist_ok=True)
    fs = retrying(inner, FakeTime())
    path = f"{root}/000000001.json"
    payloads = [bytes([i]) * 1_000_000 for i in range(8)]
    start = threading.Barrier(len(payloads))
    won: list[bytes] = []

    def create(data: bytes) -> None:
        start.wait()
        try:
            fs.pipe_file(path, data, mode="create")
            won.append(data)
        except FileExistsError:
            pass

    threads = [threading.Thread(target=create, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1
    assert inner.cat_file(path) == won[0]  # whole, and the winner's
    assert inner.ls(root, detail=False) == [inner._strip_protocol(path)]  # no temporary left


@pytest.mark.parametrize("backend", ["local", "memory"])
def test_open_for_exclusive_create(backend: str, tmp_path: Any, memfs: MemoryFileSystem) -> None:
    inner: AbstractFileSystem = LocalFileSystem() if backend == "local" else memfs
    root = str(tmp_path) if backend == "local" else "/x"
    inner.makedirs(root, exist_ok=True)
    fs = retrying(inner, FakeTime())
    with fs.open(f"{root}/new.json", "xb") as f:
        f.write(b"first")
    assert inner.cat_file(f"{root}/new.json") == b"first"
    with pytest.raises(FileExistsError):
        fs.open(f"{root}/new.json", "xb")  # refused at once, as open(path, "x") is
    with pytest.raises(FileExistsError):
        fs.open(f"{root}/new.json", "x")
    # A writer that creates the file while ours is open keeps it.
    f = fs.open(f"{root}/late.json", "xb")
    f.write(b"ours")
    inner.pipe_file(f"{root}/late.json", b"theirs")
    with pytest.raises(FileExistsError):
        f.close()
    assert inner.cat_file(f"{root}/late.json") == b"theirs"


class KeyValueFileSystem(AbstractFileSystem):
    """A backend without atomic create whose pipe_file ignores ``mode`` altogether."""

    protocol = "kv"
    cachable = False

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[str, bytes] = {}

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        self.data[self._strip_protocol(path)] = value

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._strip_protocol(path)
        if path not in self.data:
            raise FileNotFoundError(path)
        return {"name": path, "size": len(self.data[path]), "type": "file"}


def test_exclusive_create_guarantee_says_what_each_backend_does(
    tmp_path: Any, memfs: MemoryFileSystem
) -> None:
    assert exclusive_create_guarantee(retrying(LocalFileSystem(), FakeTime())) == (
        "atomic exclusive create (local filesystem: link)"
    )
    assert "atomic within one process" in exclusive_create_guarantee(retrying(memfs, FakeTime()))
    s3, _ = build_filesystem("s3://b/run", {"endpoint_url": "http://127.0.0.1:9"}, RetryConfig())
    assert exclusive_create_guarantee(s3) == "conditional write If-None-Match: * (s3)"
    assert "if-generation-match=0" in exclusive_create_guarantee(FakeGCSFileSystem())
    kv = KeyValueFileSystem()
    assert exclusive_create_guarantee(kv) == (
        "best effort: exists check then write (no atomic create on kv)"
    )
    # ... and the wrapper does that check, even where the backend ignores mode="create".
    fs = retrying(kv, FakeTime())
    fs.pipe_file("/a", b"first", mode="create")
    with pytest.raises(FileExistsError):
        fs.pipe_file("/a", b"second", mode="create")
    assert kv.data["/a"] == b"first"


def test_write_handles_upload_on_close_with_retries(memfs: MemoryFileSystem) -> None:
    scripted = ScriptedFileSystem(memfs, {"pipe_file": [ConnectionResetError("reset")] * 2})
    fs = retrying(scripted, FakeTime())
    with fs.open("/handles/snapshot.json", "wb") as f:
        f.write(b'{"step": ')
        f.write(b"10}")
    assert memfs.cat_file("/handles/snapshot.json") == b'{"step": 10}'
    assert fs.snapshot_stats().kind("upload").attempts == 3
    with fs.open("/handles/snapshot.json", "rb") as f:
        assert f.read() == b'{"step": 10}'


def test_a_write_handle_left_by_an_exception_publishes_nothing(memfs: MemoryFileSystem) -> None:
    fs = retrying(memfs, FakeTime())
    with pytest.raises(RuntimeError):
        with fs.open("/handles/half.bin", "wb") as f:
            f.write(b"first half")
            raise RuntimeError("writer died")
    assert not memfs.exists("/handles/half.bin")


def test_a_write_handle_dropped_without_close_publishes_nothing(memfs: MemoryFileSystem) -> None:
    fs = retrying(memfs, FakeTime())
    f = fs.open("/handles/dropped.bin", "wb")
    f.write(b"half of a snapshot")
    del f
    gc.collect()
    assert not memfs.exists("/handles/dropped.bin")
    f = fs.open("/handles/closed.bin", "wb")
    f.write(b"whole")
    f.close()  # an explicit close after a complete write is what publishes
    assert memfs.cat_file("/handles/closed.bin") == b"whole"
