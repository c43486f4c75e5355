"""timeline.png: a run drawn from its summary.json -- every measured phase at its real length,
every kill, hang and notice marked -- at the end of a run and by ``python -m ftjob.report``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from ftjob import metrics as M
from ftjob.cli.report import main as report
from ftjob.record import (
    FirstStep,
    Hang,
    HistoryPoint,
    Kill,
    KillTarget,
    Notice,
    NoticeSource,
    RunStatus,
    ValidationResult,
)
from ftjob.reporting.run_summary import (
    Buckets,
    ChaosSection,
    FailureRecord,
    Goodput,
    PlannedResize,
    PreemptionPart,
    Recovery,
    ResizeRecord,
    RunSummary,
    Timing,
)
from ftjob.reporting.summary import build_summary
from ftjob.reporting.timeline import marks, phase_spans, training_label, write_timeline
from tests.support.ledgers import make_ledger, restored, train

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T0 = 1_000_000.0


def story() -> RunSummary:
    """A run of 100 s: start-up 20 s, a worker kill at 40 s recovered in 12 s, a planned grow
    at 60 s, a drain notice at 70 s with a 10 s window, then a hang found at 85 s."""
    parts = {"download_s": 0.2, "load_s": 0.2, "skip_s": 0.1, "restoration_s": 0.5}
    failure = FailureRecord(
        attempt=1,
        kind="worker_kill",
        time=T0 + 40.0,
        detection_s=1.0,
        recovered=True,
        recovery=Recovery(**parts, restart_s=5.0, time_to_recover_s=12.0, lost_steps=3),
    )
    notice = Notice(NoticeSource.drain, T0 + 70.0, 60, deadline=T0 + 80.0)
    preemption = FailureRecord(
        attempt=2,
        kind="preemption",
        time=T0 + 80.0,
        detection_s=0.5,
        recovered=True,
        recovery=Recovery(**parts, restart_s=4.0, time_to_recover_s=9.0),
        preemption=PreemptionPart(notice=notice),
    )
    history = tuple(
        HistoryPoint(s, T0 + 20.0 + s, 1, loss=2.0 / s, throughput=500.0, world_size=2)
        for s in range(10, 80, 10)
    )
    hang = Hang(T0 + 85.0, 3, 1, "n1", 7, "step", 75, T0 + 64.0, 21.0, 20.0, 1.0, True, False, {})
    grow = ResizeRecord(
        attempt=2,
        kind="grow",
        from_=1,
        to=2,
        cause="planned",
        planned=PlannedResize("/ck/step_50"),
        time=T0 + 60.0,
        time_to_recover_s=8.0,
        first_step_s=1.0,
    )
    return RunSummary(
        name="story",
        status=RunStatus.succeeded,
        wall_time_s=100.0,
        timing=Timing(started=T0, first_step=T0 + 20.0, finished=T0 + 97.0),
        failures=(failure, preemption),
        chaos=ChaosSection(kills=(Kill(T0 + 40.0, "worker", KillTarget("n1", pid=7), 1),)),
        hangs=(hang,),
        resizes=(grow,),
        history=history,
        validation=(
            ValidationResult(0, 0.5, 0.8, 10, T0 + 45.0, step=30, attempt=1),
            ValidationResult(1, 0.3, 0.9, 10, T0 + 95.0, step=80, attempt=3),
        ),
        goodput=Goodput(ettr=0.5, buckets=Buckets(training=50.0, startup=20.0, restart=9.0)),
    )


def test_every_phase_is_drawn_at_its_real_length_after_its_cause() -> None:
    spans = phase_spans(story())
    assert spans[0] == ("startup", 0.0, 20.0)
    kill = [(n, round(a, 3), round(b, 3)) for n, a, b in spans[1:5]]
    assert kill == [
        ("detection", 40.0, 41.0),
        ("restart", 41.0, 46.0),
        ("restore", 46.0, 46.5),
        ("setup", 46.5, 52.0),  # the rest of the 12 s to the first step
    ]
    assert spans[5] == ("preemption", 70.0, 80.0)  # the notice's window, before its restart
    assert [n for n, _, _ in spans[6:10]] == ["detection", "restart", "restore", "setup"]
    assert spans[-2] == ("resize", 60.0, 67.0)  # a planned grow, to its first step
    assert spans[-1] == ("shutdown", 97.0, 100.0)
    assert [(kind, at) for kind, at, _ in marks(story())] == [
        ("kill", 40.0),
        ("hang", 85.0),
        ("notice", 70.0),
    ]


def test_the_training_band_names_the_waits_it_spans() -> None:
    # The band is everything no phase covers: its legend says what besides training it holds.
    buckets = Buckets(training=2.8, data_wait=5.2, validation=0.24, checkpoint=0.01)
    assert training_label(buckets) == "training (2.8 s)\nwith data wait 5.2, validation 0.2 s"
    assert training_label(Buckets(training=3.0)) == "training (3.0 s)"


def test_the_picture_is_written_and_the_report_command_draws_it_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_timeline(str(tmp_path / "direct.png"), story())
    assert (tmp_path / "direct.png").read_bytes()[:8] == PNG_MAGIC
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    summary = dataclasses.replace(story(), metrics=dict.fromkeys(M.METRIC_KEYS, 0.0))
    (run_dir / "summary.json").write_text(json.dumps(summary.document()))
    assert report([str(run_dir)]) == 0
    assert (run_dir / "timeline.png").read_bytes()[:8] == PNG_MAGIC
    assert f"timeline: {run_dir / 'timeline.png'}" in capsys.readouterr().out


def test_the_start_up_band_and_its_legend_count_from_the_same_origin() -> None:
    # The driver started at 0; its cluster took 13 s before the run ledger started; the first
    # step (its 1 s batch wait and step are training's) ended at 20 s, a worker kill at 30 s.
    ledger = make_ledger()
    ledger.started = 13.0
    a0 = ledger.begin_attempt(15.0)
    ledger.first_step(a0, FirstStep(1, 20.0, 1.0))
    train(ledger, a0, range(1, 5), audit=False)
    ledger.kill(Kill(30.0, "worker", KillTarget("n1", pid=1, rank=0), a0))
    ledger.failure_noticed(31.0, {0: "ActorDiedError"})
    a1 = ledger.begin_attempt(34.0)
    ledger.restored(a1, restored(2))
    ledger.first_step(a1, FirstStep(3, 38.0, 1.0))
    ledger.finish(45.0)
    summary = build_summary(
        ledger.snapshot(),
        name="r",
        status=RunStatus.succeeded,
        error=None,
        wall_time_s=50.0,
        config={},
        run_started=0.0,
    )
    buckets, spans = summary.goodput.buckets.seconds(), phase_spans(summary)
    drawn: dict[str, float] = {}
    for name, start, end in spans:
        drawn[name] = drawn.get(name, 0.0) + end - start
    assert spans[0] == ("startup", 0.0, 19.0) and buckets["startup"] == pytest.approx(19.0)
    for name in ("detection", "restart", "restore", "setup", "shutdown"):
        assert drawn[name] == pytest.approx(buckets[name]), name
    assert [(kind, at) for kind, at, _ in marks(summary)] == [("kill", 30.0)]
