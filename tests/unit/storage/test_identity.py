"""A run's identity on a shared cluster (:mod:`ftjob.storage.identity`): its name and its
storage, kept with the run, so that a resume finds it and another run of the same name never
has it. (The holders it names: tests/unit/driver/test_holders.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ftjob.config import RetryConfig
from ftjob.storage.fs import build_filesystem
from ftjob.storage.identity import RUN_ID_FILE, RunIdentity, run_identity


def identity(storage: str, name: str = "exp") -> RunIdentity:
    fs, root = build_filesystem(storage, {}, RetryConfig(max_attempts=1))
    return run_identity(fs, f"{root}/{name}", name)


def test_a_runs_identity_is_its_storage_and_name_kept_with_it(tmp_path: Path) -> None:
    first = identity(str(tmp_path / "a"))
    assert first.label == f"exp@{first.key}" and len(first.key) == 16
    # A resume -- another driver, the path spelled another way -- finds the same one.
    assert identity(str(tmp_path / "a")) == first
    assert identity(str(tmp_path / "a") + "/") == first
    os.symlink(tmp_path / "a", tmp_path / "link")
    assert identity(str(tmp_path / "link")) == first
    # Another storage, or another name there, is another run.
    assert identity(str(tmp_path / "b")).key != first.key
    assert identity(str(tmp_path / "a"), "exp2").key != first.key
    # The same URL on another machine (its own local disk: another kept id) is another run.
    kept = tmp_path / "a" / "exp" / RUN_ID_FILE
    moved = tmp_path / "a" / "kept"
    kept.rename(moved)
    assert identity(str(tmp_path / "a")).key != first.key
    moved.replace(kept)
    assert identity(str(tmp_path / "a")) == first


def test_a_kept_id_ftjob_did_not_write_is_refused_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / RUN_ID_FILE).write_text(json.dumps({"id": "../../etc"}))
    with pytest.raises(ValueError, match=f"{RUN_ID_FILE}: not a run id ftjob wrote.*remove it"):
        identity(str(tmp_path))
