"""fsspec's own conformance suite (``fsspec.tests.abstract``) on ``RetryingFileSystem``.

The wrapper is what Ray Train and the checkpoint store call as their fsspec filesystem, so it
must answer every call as the filesystem it wraps would. Each suite runs on the retrying wrapper
over the local filesystem and over s3fs, and on the plain local filesystem as the baseline. No
case is marked xfail on the wrapper: it passes every case, also the one plain s3fs fails
(``test_open_exclusive``: s3fs checks ``"x"`` mode only when the file is committed, and the
wrapper refuses it when it is opened). Plain s3fs is not run here -- that is s3fs's suite,
and it would double the time this file takes.

The S3 classes run against moto's server on loopback (``s3_endpoint``, marked ``s3``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.tests import abstract

from ftjob.config import RetryConfig
from ftjob.storage.fs import RetryingFileSystem, build_filesystem
from ftjob.storage.retry import RetryPolicy
from ftjob.storage.wrapper import exclusive_create_guarantee
from tests.support.s3_fixtures import new_bucket

SUITES = (
    abstract.AbstractCopyTests,
    abstract.AbstractGetTests,
    abstract.AbstractPutTests,
    abstract.AbstractOpenTests,
    abstract.AbstractPipeTests,
)


# -- fixtures per backend ----------------------------------------------------------------------


class LocalFixtures(abstract.AbstractFixtures):
    """As fsspec's own local fixtures: the filesystem side and the local side share tmpdir."""

    @pytest.fixture
    def fs(self) -> AbstractFileSystem:
        return LocalFileSystem(auto_mkdir=True)

    @pytest.fixture
    def fs_path(self, tmpdir: Any) -> str:
        return str(tmpdir)


class RetryingLocalFixtures(LocalFixtures):
    @pytest.fixture
    def fs(self) -> AbstractFileSystem:
        return RetryingFileSystem(LocalFileSystem(auto_mkdir=True), RetryPolicy(RetryConfig()))


class RetryingS3Fixtures(abstract.AbstractFixtures):
    """As s3fs's own derived fixtures (paths are ``bucket/key``, no empty directories), with
    the retrying wrapper as the filesystem."""

    @pytest.fixture
    def s3_options(self, s3_endpoint: str) -> dict[str, Any]:
        return {"endpoint_url": s3_endpoint}

    @pytest.fixture
    def fs_join(self) -> Callable[..., str]:
        return lambda *parts: "/".join(parts)

    @pytest.fixture
    def fs_path(self, s3_bucket: str) -> str:
        return s3_bucket

    @pytest.fixture
    def supports_empty_directories(self) -> bool:
        return False

    @pytest.fixture
    def fs(self, s3_options: dict[str, Any], s3_bucket: str) -> AbstractFileSystem:
        # s3fs keeps one instance (and its client) per option set: reused across these tests,
        # each in a bucket of its own, with listings cached by none of them.
        fs, _ = build_filesystem(f"s3://{s3_bucket}", s3_options, RetryConfig())
        fs.invalidate_cache()
        return fs


# -- the suites ------------------------------------------------------------------------------


class TestLocalCopy(abstract.AbstractCopyTests, LocalFixtures):
    pass


class TestLocalGet(abstract.AbstractGetTests, LocalFixtures):
    pass


class TestLocalPut(abstract.AbstractPutTests, LocalFixtures):
    pass


class TestLocalOpen(abstract.AbstractOpenTests, LocalFixtures):
    pass


class TestLocalPipe(abstract.AbstractPipeTests, LocalFixtures):
    pass


class TestRetryingLocalCopy(abstract.AbstractCopyTests, RetryingLocalFixtures):
    pass


class TestRetryingLocalGet(abstract.AbstractGetTests, RetryingLocalFixtures):
    pass


class TestRetryingLocalPut(abstract.AbstractPutTests, RetryingLocalFixtures):
    pass


class TestRetryingLocalOpen(abstract.AbstractOpenTests, RetryingLocalFixtures):
    pass


class TestRetryingLocalPipe(abstract.AbstractPipeTests, RetryingLocalFixtures):
    pass


@pytest.mark.s3
class TestRetryingS3Copy(abstract.AbstractCopyTests, RetryingS3Fixtures):
    pass


@pytest.mark.s3
class TestRetryingS3Get(abstract.AbstractGetTests, RetryingS3Fixtures):
    pass


@pytest.mark.s3
class TestRetryingS3Put(abstract.AbstractPutTests, RetryingS3Fixtures):
    pass


@pytest.mark.s3
class TestRetryingS3Open(abstract.AbstractOpenTests, RetryingS3Fixtures):
    pass


@pytest.mark.s3
class TestRetryingS3Pipe(abstract.AbstractPipeTests, RetryingS3Fixtures):
    pass


# -- beyond fsspec's suite: the same call answers the same, plain or wrapped -----------------

# Read-only calls, each made on the plain filesystem and on the wrapper over the same tree:
# results must be equal, or both calls must raise the same type.
QUERIES: dict[str, Callable[[AbstractFileSystem, str], Any]] = {
    "ls": lambda fs, root: fs.ls(root, detail=False),
    "ls detail": lambda fs, root: sorted(fs.ls(root, detail=True), key=lambda e: e["name"]),
    "find": lambda fs, root: fs.find(root),
    "find withdirs detail": lambda fs, root: fs.find(root, withdirs=True, detail=True),
    "find maxdepth": lambda fs, root: fs.find(root, maxdepth=1),
    "walk": lambda fs, root: list(fs.walk(root)),
    "glob **": lambda fs, root: fs.glob(f"{root}/**/*.txt"),
    "glob prefix": lambda fs, root: fs.glob(f"{root}/sub*"),
    "expand_path": lambda fs, root: fs.expand_path(f"{root}/sub*", recursive=True),
    "exists file": lambda fs, root: fs.exists(f"{root}/a.txt"),
    "exists missing": lambda fs, root: fs.exists(f"{root}/missing"),
    "isdir": lambda fs, root: (fs.isdir(f"{root}/sub"), fs.isdir(f"{root}/a.txt")),
    "isfile": lambda fs, root: (fs.isfile(f"{root}/sub"), fs.isfile(f"{root}/a.txt")),
    "info": lambda fs, root: fs.info(f"{root}/a.txt"),
    "info missing": lambda fs, root: fs.info(f"{root}/missing"),
    "modified": lambda fs, root: fs.modified(f"{root}/a.txt"),
    "modified of a directory": lambda fs, root: type(fs.modified(f"{root}/sub")),
    "size": lambda fs, root: (fs.size(f"{root}/a.txt"), fs.sizes([f"{root}/sub/b.txt"])),
    "du": lambda fs, root: (fs.du(root), fs.du(root, total=False)),
    "cat recursive": lambda fs, root: fs.cat(f"{root}/sub", recursive=True),
    "cat_file range": lambda fs, root: fs.cat_file(f"{root}/a.txt", start=2, end=5),
    "cat_file missing": lambda fs, root: fs.cat_file(f"{root}/missing"),
    "cat_ranges": lambda fs, root: fs.cat_ranges([f"{root}/a.txt"] * 2, [0, 3], [2, 6]),
    "head tail": lambda fs, root: (fs.head(f"{root}/a.txt", 3), fs.tail(f"{root}/a.txt", 3)),
    "checksum": lambda fs, root: fs.checksum(f"{root}/a.txt"),
}

# Calls that change the tree: made on two copies of it, then both trees are compared.
CHANGES: dict[str, Callable[[AbstractFileSystem, str], Any]] = {
    "rm a glob": lambda fs, root: fs.rm(f"{root}/sub*", recursive=True),
    "rm a list": lambda fs, root: fs.rm([f"{root}/a.txt", f"{root}/sub/b.txt"]),
    "rm a directory without recursive": lambda fs, root: fs.rm(f"{root}/sub"),
    "rm missing": lambda fs, root: fs.rm(f"{root}/missing"),
    "mv a directory": lambda fs, root: fs.mv(f"{root}/sub", f"{root}/moved", recursive=True),
    "copy a glob": lambda fs, root: fs.copy(f"{root}/sub/*.txt", f"{root}/copied/"),
    "pipe a dict": lambda fs, root: fs.pipe({f"{root}/p1": b"1", f"{root}/p2": b"2"}),
    "touch": lambda fs, root: fs.touch(f"{root}/new.txt"),
    "rmdir of a non-empty one": lambda fs, root: fs.rmdir(f"{root}/sub"),
}


def _outcome(
    call: Callable[[AbstractFileSystem, str], Any], fs: AbstractFileSystem, root: str
) -> tuple[str, Any, type | None]:
    try:
        return ("returned", call(fs, root), None)
    except Exception as exc:  # the wrapper adds context to the message, never changes the type
        return ("raised", None, type(exc))


def _tree(fs: AbstractFileSystem, root: str) -> dict[str, bytes]:
    return {p[len(root) :]: fs.cat_file(p) for p in fs.find(root)}


def _make_tree(fs: AbstractFileSystem, join: Callable[..., str], root: str) -> None:
    fs.pipe_file(join(root, "a.txt"), b"0123456789")
    fs.pipe_file(join(root, "sub", "b.txt"), b"bee")
    fs.pipe_file(join(root, "sub", "deep", "c.txt"), b"sea")
    fs.pipe_file(join(root, "subfile.bin"), b"\x00")


def _check_queries(
    call: Callable[[AbstractFileSystem, str], Any],
    plain: AbstractFileSystem,
    wrapped: AbstractFileSystem,
    root: str,
) -> None:
    assert _outcome(call, wrapped, root) == _outcome(call, plain, root)


def _check_changes(
    call: Callable[[AbstractFileSystem, str], Any],
    plain: AbstractFileSystem,
    wrapped: AbstractFileSystem,
    roots: tuple[str, str],
) -> None:
    # What a change returns is the store's answer to a request (ids, dates); whether it
    # raised, and what it left, are what must match.
    assert _outcome(call, wrapped, roots[1])[::2] == _outcome(call, plain, roots[0])[::2]
    assert _tree(wrapped, roots[1]) == _tree(plain, roots[0])


@pytest.fixture
def local_pair(tmp_path: Any) -> tuple[AbstractFileSystem, AbstractFileSystem]:
    plain = LocalFileSystem(auto_mkdir=True)
    return plain, RetryingFileSystem(plain, RetryPolicy(RetryConfig()))


@pytest.mark.parametrize("call", QUERIES.values(), ids=QUERIES.keys())
def test_local_queries_answer_as_the_local_filesystem(
    call: Callable[[AbstractFileSystem, str], Any], local_pair: Any, tmp_path: Any
) -> None:
    plain, wrapped = local_pair
    _make_tree(plain, os.path.join, str(tmp_path))
    _check_queries(call, plain, wrapped, str(tmp_path))


@pytest.mark.parametrize("call", CHANGES.values(), ids=CHANGES.keys())
def test_local_changes_act_as_on_the_local_filesystem(
    call: Callable[[AbstractFileSystem, str], Any], local_pair: Any, tmp_path: Any
) -> None:
    plain, wrapped = local_pair
    roots = (str(tmp_path / "plain"), str(tmp_path / "wrapped"))
    for root in roots:
        _make_tree(plain, os.path.join, root)
    _check_changes(call, plain, wrapped, roots)


@pytest.fixture
def s3_pair(
    s3_options: dict[str, Any], s3_bucket: str
) -> tuple[AbstractFileSystem, AbstractFileSystem]:
    import s3fs

    wrapped, _ = build_filesystem(f"s3://{s3_bucket}", s3_options, RetryConfig())
    return s3fs.S3FileSystem(**s3_options), wrapped


@pytest.fixture
def s3_options(s3_endpoint: str) -> Iterator[dict[str, Any]]:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    yield {"endpoint_url": s3_endpoint}
    s3fs.S3FileSystem.clear_instance_cache()


def _s3_join(*parts: str) -> str:
    return "/".join(parts)


@pytest.fixture(scope="module")
def s3_tree(s3_endpoint: str) -> Iterator[tuple[AbstractFileSystem, AbstractFileSystem, str]]:
    """One tree for every read-only query: plain s3fs, the wrapper, the tree's root."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    options, bucket = {"endpoint_url": s3_endpoint}, new_bucket(s3_endpoint)
    wrapped, _ = build_filesystem(f"s3://{bucket}", options, RetryConfig())
    plain = s3fs.S3FileSystem(**options)
    _make_tree(plain, _s3_join, f"{bucket}/tree")
    yield plain, wrapped, f"{bucket}/tree"
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.s3
@pytest.mark.parametrize("call", QUERIES.values(), ids=QUERIES.keys())
def test_s3_queries_answer_as_s3fs(
    call: Callable[[AbstractFileSystem, str], Any], s3_tree: Any
) -> None:
    plain, wrapped, root = s3_tree
    for fs in (plain, wrapped):
        fs.invalidate_cache()  # each call asks the store, as on a new instance
    _check_queries(call, plain, wrapped, root)


@pytest.mark.s3
@pytest.mark.parametrize("call", CHANGES.values(), ids=CHANGES.keys())
def test_s3_changes_act_as_on_s3fs(
    call: Callable[[AbstractFileSystem, str], Any], s3_pair: Any, s3_bucket: str
) -> None:
    plain, wrapped = s3_pair
    roots = (f"{s3_bucket}/plain", f"{s3_bucket}/wrapped")
    for root in roots:
        _make_tree(plain, _s3_join, root)
    plain.invalidate_cache()
    _check_changes(call, plain, wrapped, roots)


@pytest.mark.s3
def test_s3_exclusive_create_is_the_stores_conditional_write(s3_pair: Any, s3_bucket: str) -> None:
    plain, wrapped = s3_pair
    assert exclusive_create_guarantee(wrapped) == "conditional write If-None-Match: * (s3)"
    path = f"{s3_bucket}/lease/000000001.json"
    f = wrapped.open(path, "xb")
    f.write(b"ours")
    plain.pipe_file(path, b"theirs")  # another driver, between our open and our close
    with pytest.raises(FileExistsError) as info:
        f.close()
    refusal = info.value.__cause__.__cause__  # ours <- s3fs's <- botocore's: S3 said no
    assert refusal.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert plain.cat_file(path) == b"theirs"
    stats = wrapped.snapshot_stats().kind("upload")
    assert (stats.attempts, stats.retries) == (1, 0)  # an existing file is not retried
