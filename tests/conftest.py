"""Fixtures for every test under tests/. Ray-backed tests are marked ``ray``; S3 tests ``s3``
(see support/s3_fixtures.py)."""

from __future__ import annotations

import os

import pytest

pytest_plugins = ["tests.support.s3_fixtures"]


@pytest.fixture(autouse=True, scope="session")
def _quiet_env() -> None:
    # Ray's token-auth banner and usage stats are noise in test logs.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(autouse=True, scope="session")
def _schema() -> None:
    # What `python -m ftjob` does first: conf/config.yaml extends the typed schema. Any test
    # that composes a config then works alone, not only after one that registered it.
    from ftjob.config import register_schema

    register_schema()


def pytest_itemcollected(item: pytest.Item) -> None:
    # The README's test command runs the suite on two pytest-xdist workers with
    # ``--dist loadgroup``: every test that starts a Ray (marked ``ray``) goes to one group, so
    # one Ray runs at a time (its dashboard agent and client server take fixed ports), beside
    # the in-process tests on the other worker. (Marked as each item is collected: xdist reads
    # the groups in its own pytest_collection_modifyitems.)
    if item.get_closest_marker("ray"):
        item.add_marker(pytest.mark.xdist_group("ray"))
