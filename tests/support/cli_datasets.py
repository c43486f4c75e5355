"""Datasets that misbehave on purpose, for command-line tests (``dataset._target_=...``)."""

from __future__ import annotations

import os
import time

import pyarrow as pa

from ftjob.data.datasets import DigitsDataset


class SlowListingDataset(DigitsDataset):
    """Listing takes a minute (a huge bucket): long enough to press Ctrl-C during it."""

    def catalog(self, split: str) -> pa.Table:
        mark = os.environ.get("FTJOB_TEST_LISTING_MARK")
        if mark:  # tell the test that listing has begun
            open(mark, "w").close()
        time.sleep(60)
        return super().catalog(split)


class BuggyDataset(DigitsDataset):
    """A bug in user code: not bad input, an unexpected error."""

    def catalog(self, split: str) -> pa.Table:
        return {}["no such key"]
