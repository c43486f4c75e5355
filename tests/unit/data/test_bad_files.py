"""dataset.max_bad_fraction (ftjob/data/bad_files.py, and where it is held: the skip log every
rank's stream calls, the run ledger's count, the Parquet catalog). No Ray: the ledger's sample
audit is a plain object here, as in tests/support/local_run.py."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from ftjob.config import ConfigError
from ftjob.data.bad_files import MAX_BAD_FRACTION, bad_limit, over_budget
from ftjob.data.datasets import GONE, TRAIN, VAL, BadFile, DataError, ImageFolderDataset
from ftjob.data.parquet import ParquetDataset
from ftjob.data.streams import SkipLog
from ftjob.driver.ledger.samples import SampleAudit


def test_the_limit_is_the_fraction_of_the_split_rounded_down():
    assert MAX_BAD_FRACTION == 0.01
    assert [bad_limit(n, 0.01) for n in (0, 99, 100, 1_281_167)] == [0, 0, 1, 12_811]
    assert bad_limit(100, 0.07) == 7 and bad_limit(5, 1.0) == 5
    assert over_budget(TRAIN, 12_811, 1_281_167, 0.01) is None
    said = over_budget(TRAIN, 12_812, 1_281_167, 0.01, "a.jpg: truncated")
    assert said is not None
    assert said.startswith("12812 of the 1281167 train samples are bad files skipped (e.g. a.jpg")
    assert "more than dataset.max_bad_fraction=0.01 of the split (12811)" in said


@pytest.mark.parametrize("value", [-0.1, 1.5, "1%", True])
def test_a_fraction_outside_0_to_1_is_refused_naming_the_key(tmp_path: Path, value: object):
    with pytest.raises(ConfigError) as err:
        ImageFolderDataset(path=str(tmp_path), max_bad_fraction=value)  # type: ignore[arg-type]
    assert err.value.key == "dataset.max_bad_fraction" and "from 0 to 1" in err.value.rule


class Listed:
    """A dataset as the skip log sees it: its fraction, and a reason for any row."""

    def __init__(self, fraction: float) -> None:
        self.max_bad_fraction = fraction

    def bad_file(self, row: dict) -> BadFile:
        return BadFile(f"file {row['id']}", "did not decode")


def catalog(rows: int, gone: list[int] = ()) -> pa.Table:
    columns = {"id": np.arange(rows), "label": np.zeros(rows, np.int64)}
    if gone:
        columns[GONE] = np.isin(np.arange(rows), gone)
    return pa.table(columns)


def skip_logs(audit: SampleAudit, catalogs: dict[str, pa.Table], ranks: int = 2) -> list[SkipLog]:
    """Each rank's skip log, telling one run ledger's sample audit."""

    def tell(rank: int):
        return lambda files: audit.skipped_files(0, rank, files)

    return [SkipLog(Listed(0.01), catalogs, tell(r)) for r in range(ranks)]  # type: ignore[arg-type]


def test_the_run_fails_once_the_ranks_together_pass_the_fraction_and_at_every_skip_after():
    audit = SampleAudit(lambda line: None)
    rank0, rank1 = skip_logs(audit, {TRAIN: catalog(200), VAL: catalog(50)})
    rank0(TRAIN, np.array([3]))
    rank1(TRAIN, np.array([3, 7]))  # 3 met by both ranks is one bad sample: 2 of 200 allowed
    with pytest.raises(DataError, match="3 of the 200 train samples are bad files skipped"):
        rank0(TRAIN, np.array([11]))
    # Seen already, and still past it: a stream read again (validation after its prefetch
    # failed) meets the error too, instead of going on without the samples.
    with pytest.raises(DataError, match="3 of the 200 train samples"):
        rank0(TRAIN, np.array([11]))
    with pytest.raises(DataError, match="3 of the 200 train samples"):
        rank1(TRAIN, np.array([11]))
    assert audit.skipped_files(0, 0, []) == {TRAIN: 3}


def test_each_split_has_its_own_fraction():
    audit = SampleAudit(lambda line: None)
    [rank0] = skip_logs(audit, {TRAIN: catalog(200), VAL: catalog(50)}, ranks=1)
    rank0(TRAIN, np.array([3, 4]))  # 2 of 200
    with pytest.raises(DataError, match=r"1 of the 50 val samples .* \(e.g. file 9: did not"):
        rank0(VAL, np.array([9]))


def test_files_removed_since_the_run_started_are_not_bad_files():
    audit = SampleAudit(lambda line: None)
    [rank0] = skip_logs(audit, {TRAIN: catalog(100, gone=[0, 1, 2]), VAL: catalog(10)}, ranks=1)
    rank0(TRAIN, np.array([0, 1, 2, 5]))  # three removed, one bad: 1 of 100 allowed
    with pytest.raises(DataError, match="2 of the 100 train samples"):
        rank0(TRAIN, np.array([6]))


def png(value: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(out, format="PNG")
    return out.getvalue()


def test_parquet_rows_without_a_label_past_the_fraction_are_refused_before_anything_trains(
    tmp_path: Path,
):
    for split, n in ((TRAIN, 200), (VAL, 10)):
        (tmp_path / split).mkdir()
        labels = [None if split == TRAIN and i < 3 else i % 2 for i in range(n)]
        table = pa.table({"image": pa.array([png(i) for i in range(n)]), "label": labels})
        pq.write_table(table, tmp_path / split / "a.parquet")
    with pytest.raises(ValueError) as err:
        ParquetDataset(str(tmp_path), bad_files="skip").catalog(TRAIN)
    said = str(err.value)
    assert "3 of the 200 train samples are bad files skipped (e.g. " in said
    assert f"{tmp_path / TRAIN / 'a.parquet'} row 0: no label" in said
    assert "dataset.max_bad_fraction=0.01 of the split (2)" in said
    allowed = ParquetDataset(str(tmp_path), bad_files="skip", max_bad_fraction=0.02)
    assert allowed.catalog(TRAIN).num_rows == 200
