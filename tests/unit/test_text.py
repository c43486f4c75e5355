"""A line cut to fit is cut at a sentence's end or between words, with an ellipsis -- never in
the middle of a word -- wherever a run prints or records an error it had to shorten."""

from __future__ import annotations

from ftjob.driver.ledger import one_line
from ftjob.driver.runner import fit_end
from ftjob.text import ELLIPSIS, shorten

# What Ray says of a worker whose process died (the last line of a WorkerGroupError).
RAY_SAYS = (
    "The actor died unexpectedly before finishing this task. Worker unexpectedly exits with a "
    "connection error code 2. End of file. There are some potential root causes. (1) The "
    "process is killed by SIGKILL by OOM killer due to high memory usage. (2) ray stop --force "
    "is called. (3) The worker is crashed unexpectedly due to SIGSEGV or other unexpected "
    "errors. " * 3
)


def test_a_line_is_cut_at_a_sentence_or_a_word_with_an_ellipsis() -> None:
    assert shorten("  fits as it is \n", 20) == "fits as it is"
    assert shorten(RAY_SAYS, 140) == (
        "The actor died unexpectedly before finishing this task. Worker unexpectedly exits "
        "with a connection error code 2. End of file." + ELLIPSIS
    )
    # No sentence ends in the second half of what fits: between two words.
    assert shorten("one two three, four five six seven", 22) == "one two three" + ELLIPSIS
    assert shorten("x" * 50, 10) == "xxxxxx..."  # nothing to cut at: where it must
    for limit in range(8, 400, 7):
        cut = shorten(RAY_SAYS, limit)
        assert len(cut) <= limit and cut.endswith(ELLIPSIS.strip())
        kept = cut.removesuffix(ELLIPSIS)
        assert RAY_SAYS.startswith(kept) and RAY_SAYS[len(kept)] in " .", (limit, cut)


def test_a_failed_runs_error_and_its_failure_record_end_on_a_word() -> None:
    error = RuntimeError(f"worker group failed:\n{RAY_SAYS}")
    said = fit_end(error).error
    assert said is not None and said.startswith("RuntimeError: The actor died unexpectedly")
    assert said.endswith(". ...") and len(said) <= len("RuntimeError: ") + 400
    recorded = one_line(RuntimeError(RAY_SAYS))
    assert recorded.endswith(". ...") and "End of file." in recorded, recorded
