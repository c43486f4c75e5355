"""The progress line's ETA and data-wait share (ftjob/driver/ledger/pace.py), through the
ledger's step log as the driver prints it."""

from __future__ import annotations

from ftjob import metrics as M
from ftjob.driver.ledger.pace import clock
from ftjob.driver.ledger.steps import StepLog
from ftjob.record import Progress


def point(step: int, time: float) -> Progress:
    return Progress(
        step=step, epoch=0, epochs=1, total_steps=100, loss=0.5, throughput=64.0, lr=0.1, time=time
    )


def timers(steps: int, step_s: float, wait_s: float) -> dict[str, float]:
    return {M.TRAIN_STEPS_COMPLETED: steps, M.TRAIN_STEP: step_s, M.TRAIN_ITER_BATCH: wait_s}


def test_the_eta_is_the_steps_left_at_the_measured_rate_and_the_wait_share_is_of_step_time() -> (
    None
):
    lines: list[str] = []
    log = StepLog(lines.append)
    # The first point: 10 steps of 0.3 s (0.2 training + 0.1 waiting) -> 90 steps left x 0.3 s.
    log.progress_update(0, point(10, 1000.0), timers(10, 2.0, 1.0), 2)
    assert lines[-1].endswith("| 64 img/s | ETA 0:27 | data wait 33%"), lines
    # From then on the wall clock between points: 10 steps in 20 s (validation, checkpoints
    # and all) -> 80 steps left x 2 s; the span's wait share: 3 s of 4.
    log.progress_update(0, point(20, 1020.0), timers(20, 3.0, 4.0), 2)
    assert lines[-1].endswith("| ETA 2:40 | data wait 75%"), lines


def test_a_new_attempt_or_a_restore_behind_the_last_point_measures_afresh() -> None:
    lines: list[str] = []
    log = StepLog(lines.append)
    log.progress_update(0, point(40, 1000.0), timers(40, 4.0, 0.0), 2)
    # Attempt 1 restored step 30 and trained to 40 again, slower: its own metrics count, not
    # the span from attempt 0's point (which would be 10 steps in 500 s of recovery).
    log.progress_update(1, point(40, 1500.0), timers(40, 20.0, 20.0), 1)
    assert lines[-1].endswith("| ETA 1:00 | data wait 50%"), lines


def test_no_eta_before_any_step_is_measured() -> None:
    lines: list[str] = []
    StepLog(lines.append).progress_update(0, point(0, 1000.0), {}, 2)
    assert lines[-1].endswith("img/s"), lines


def test_the_clock_reads_minutes_below_an_hour_and_hours_from_one() -> None:
    assert [clock(s) for s in (0, 59.6, 61, 3599, 3600, 90061)] == [
        "0:00",
        "1:00",
        "1:01",
        "59:59",
        "1:00:00",
        "25:01:01",
    ]


def test_the_eta_is_for_the_whole_job_not_the_epoch() -> None:
    # 3 epochs of 20 steps: at step 25 (epoch 2) 35 steps are left, at 2 s each -- the ETA
    # counts the epochs still to come (15 steps left in the epoch would say 0:30).
    lines: list[str] = []
    log = StepLog(lines.append)
    at = [Progress(s, s // 20, 3, 60, 0.5, 64.0, 0.1, time=t) for s, t in ((20, 0.0), (25, 10.0))]
    log.progress_update(0, at[0], timers(20, 20.0, 0.0), 1)
    log.progress_update(0, at[1], timers(25, 25.0, 5.0), 1)
    assert "epoch 2/3 step 25/60" in lines[-1] and lines[-1].endswith("| ETA 1:10 | data wait 50%")


def test_the_line_says_where_a_steps_time_went_where_the_input_is_timed() -> None:
    lines: list[str] = []
    log = StepLog(lines.append)
    first = {
        **timers(10, 2.0, 1.0),
        M.DATA_READ: 0.1,
        M.DATA_DECODE: 0.5,
        M.DATA_AUGMENT: 0.2,
        M.CHECKPOINT_MEMORY_SNAPSHOT_TIME: 0.3,
    }
    log.progress_update(0, point(10, 1000.0), first, 1)
    assert lines[-1].endswith(
        "| ms a step: read 10.0, decode 50.0, augment 20.0, step 200.0, snapshot 30.0"
    ), lines
    # Over the span since the last point: 10 more steps, 1.0 s more decoding, 0.05 s copying.
    later = {**first, **timers(20, 4.0, 1.0), M.DATA_DECODE: 1.5, M.DATA_COPY: 0.05}
    log.progress_update(0, point(20, 1030.0), later, 1)
    assert lines[-1].endswith("| ms a step: copy 5.0, decode 100.0, step 200.0"), lines
