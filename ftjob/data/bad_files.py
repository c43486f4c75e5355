"""How many bad samples a run may skip (``dataset.max_bad_fraction``).

``dataset.bad_files=skip`` leaves a file that does not decode (a row without a label, with
Parquet) out of every epoch. A few among many barely change training; a whole split of them --
a column of the wrong type, a tree of files that are not images -- would make a run train on
nothing and succeed. So a split may lose at most this fraction of its samples: more is the
run's error, naming the count, the split's size and the key to raise.

The fraction is of the split's catalog (every sample the user pointed at), and a run fails as
soon as it is known to be exceeded: when the bad samples met so far -- by any rank, in any
attempt of this driver, each counted once -- are more than the fraction of the whole split.
That is a lower bound of the split's true count, so a run never fails that would have stayed
within it; and a split that is all bad fails within its first ``fraction`` of samples, not at
the end of an epoch. Rows known bad when the catalog is built (Parquet rows without a label)
are counted before Ray starts.
"""

from __future__ import annotations

import math

# dataset.max_bad_fraction: ImageNet's 1.28 M training files have none that PIL cannot
# decode; scraped sets lose a fraction of a percent. 1 % leaves those room (12,800 files of
# ImageNet), and a split that is all bad fails within its first 1 %.
MAX_BAD_FRACTION = 0.01


def bad_limit(rows: int, fraction: float) -> int:
    """The most bad samples a split of ``rows`` may skip."""
    return math.floor(rows * fraction + 1e-9)  # 0.07 of 100 is 7, not 6.999...


def over_budget(split: str, bad: int, rows: int, fraction: float, example: str = "") -> str | None:
    """Why a split with (at least) ``bad`` bad samples of ``rows`` exceeds ``fraction``, on
    one line (``example``: a bad sample and its reason), or None when it does not."""
    if bad <= bad_limit(rows, fraction):
        return None
    seen = f" (e.g. {example})" if example else ""
    return (
        f"{bad} of the {rows} {split} samples are bad files skipped{seen}, more than "
        f"dataset.max_bad_fraction={fraction} of the split ({bad_limit(rows, fraction)}): the "
        "run would train on less than the data it was pointed at; fix the data (python -m "
        "ftjob.check --data lists every bad file), or raise dataset.max_bad_fraction"
    )
