"""A worker's preemption notices, without Ray: a drain mark with its deadline, the driver's
request, and a SIGTERM taken over from Ray's handler."""

from __future__ import annotations

import math

from ftjob.worker.preemption import DRAIN, DRIVER, WORKER, PreemptionNotices


def test_a_drain_notice_carries_its_deadline_and_wins_over_nothing():
    drain: list = [None]  # what Ray Train's drain mark says, as the worker reads it
    notices = PreemptionNotices(world=1, device="cpu", drain_notice=lambda: drain[0])
    assert notices.agree() is None and not notices.noticed()
    drain[0] = (1_000_030.0, [1])
    notice = notices.agree()
    assert notice is not None and (notice.source, notice.deadline) == (DRAIN, 1_000_030.0)
    assert notice.remaining(1_000_000.0) == 30.0 and notices.drain_ranks == [1]


def test_a_driver_request_is_a_notice_without_a_deadline():
    notices = PreemptionNotices(world=1, device="cpu", drain_notice=lambda: None)
    notices.requested.set()  # what the ledger poller does when the driver got SIGTERM
    notice = notices.agree()
    assert notice is not None and notice.source == DRIVER and notice.deadline is None
    assert math.isinf(notice.remaining(0.0))


def test_sigterm_to_a_worker_is_a_notice_once_then_rays_exit_again(monkeypatch):
    import ray._private.worker as ray_worker

    exits: list[str] = []
    monkeypatch.setattr(
        ray_worker, "raise_sys_exit_with_custom_error_message", lambda m, c=1: exits.append(m)
    )
    original = ray_worker.raise_sys_exit_with_custom_error_message
    notices = PreemptionNotices(world=1, device="cpu", sigterm=True)
    # What Ray's SIGTERM handler calls on the worker's main thread:
    ray_worker.raise_sys_exit_with_custom_error_message("The process receives a SIGTERM.", 1)
    assert exits == [] and notices.terminated.is_set()  # taken over: a notice, no exit
    notice = notices.agree()
    assert notice is not None and notice.source == WORKER and notice.deadline is None
    ray_worker.raise_sys_exit_with_custom_error_message("The process receives a SIGTERM.", 1)
    assert exits == ["The process receives a SIGTERM."]  # a second one exits as Ray would
    notices.close()
    assert ray_worker.raise_sys_exit_with_custom_error_message is original
