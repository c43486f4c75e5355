"""summary.json as the tests read it: a document checked against the types it is written from
(:mod:`ftjob.reporting.schema`), and its audit's verdict per epoch."""

from __future__ import annotations

from typing import Any

from ftjob.reporting.run_summary import EpochAudit
from ftjob.reporting.schema import check_summary


def checked(document: dict[str, Any]) -> dict[str, Any]:
    """``document`` (a summary.json), after checking it holds what RunSummary's types say --
    every key a summary always has, no key they do not know, each value of its type."""
    _, problems = check_summary(document)
    assert not problems, f"summary.json against its schema: {problems}"
    return document


def exactly_once(epoch_audit: dict[str, Any]) -> bool:
    """An epoch of summary.json's ``audit``: every sample trained once, each step on its own
    global batch."""
    return EpochAudit.from_json(epoch_audit).exactly_once
