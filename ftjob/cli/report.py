"""``python -m ftjob.report DIR``: rebuild a sweep's report, or print one run's summary.

``DIR`` may also be a run in its storage (``s3://bucket/runs/NAME``, its ``outputs/`` folder,
or a local checkpoint.storage_path's run directory): the outputs mirrored there
(:mod:`ftjob.reporting.outputs`) are copied into a local folder and read from it.

A sweep dir (finished, partial or failed) gets its sweep_summary.csv/.md/.png rebuilt from the
job dirs' own files (:func:`ftjob.reporting.sweep.build_sweep_report`); a run dir (one holding
summary.json) is printed as the run printed it at its end (:func:`ftjob.reporting.summary.format_summary`)
and its ``timeline.png`` drawn again (:mod:`ftjob.reporting.timeline`). A run dir without
summary.json whose driver kept its record (``run_record.jsonl``: the driver did not end) has its
summary rebuilt from that record and printed, saying so (:mod:`ftjob.reporting.run_record`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from ftjob.config import RetryConfig
from ftjob.reporting.outputs import EARLIER_DIR, TRACEBACK_FILE, fetch_outputs, outputs_root
from ftjob.reporting.run_record import RECORD_FILE, read_record, rebuilt_summary
from ftjob.reporting.summary import SUMMARY_FILE, format_summary, read_summary
from ftjob.reporting.sweep import (
    OVERRIDES_FILE,
    SWEEP_MD,
    build_sweep_report,
    find_job_dirs,
    read_yaml_list,
    report_text,
)
from ftjob.reporting.timeline import draw_timeline


def summarise_run(run_dir: str) -> int:
    if not os.path.isfile(os.path.join(run_dir, SUMMARY_FILE)):
        return summarise_kept_record(run_dir)
    try:
        summary = read_summary(os.path.join(run_dir, SUMMARY_FILE))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"ftjob.report: {run_dir}: unreadable {SUMMARY_FILE} ({exc})", file=sys.stderr)
        return 2
    overrides_path = os.path.join(run_dir, OVERRIDES_FILE)
    overrides = read_yaml_list(overrides_path) if os.path.isfile(overrides_path) else []
    if overrides:
        print("overrides: " + " ".join(overrides))
    print(format_summary(summary))
    print(draw_timeline(summary, run_dir))
    trace = os.path.join(run_dir, TRACEBACK_FILE)
    if os.path.isfile(trace):  # a driver stopped by a bug
        print(f"traceback: {trace}")
    return 0


def summarise_kept_record(run_dir: str) -> int:
    """A run dir without summary.json whose driver kept its record (it did not end: SIGKILL,
    its machine lost): the summary rebuilt from that record, printed, and its timeline."""
    try:
        kept = read_record(run_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"ftjob.report: {run_dir}: unreadable {RECORD_FILE} ({exc})", file=sys.stderr)
        return 2
    if kept is None:
        print(f"ftjob.report: {run_dir}: no {SUMMARY_FILE}, no record", file=sys.stderr)
        return 2
    summary = rebuilt_summary(kept)
    print(f"rebuilt from {os.path.join(run_dir, RECORD_FILE)}: the driver did not end")
    print(format_summary(summary))
    if summary.resume_command:
        print(f"to continue from {summary.checkpoints.latest}: {summary.resume_command}")
    print(draw_timeline(summary, run_dir))
    return 0


def from_storage(url: str) -> str | None:
    """A run's mirrored outputs at ``url`` (the run's directory in its storage, or its
    ``outputs/``), copied into a new local folder; that folder, or None when ``url`` holds
    none. Credentials and endpoints come from the environment, as for checkpoint.storage_path."""
    from ftjob.storage.fs import build_filesystem

    fs, path = build_filesystem(url, {}, RetryConfig(max_attempts=3))
    root = outputs_root(fs, path)
    if root is None:
        return None
    name = os.path.basename(path.rstrip("/").removesuffix("/outputs")) or "run"
    local = tempfile.mkdtemp(prefix=f"ftjob-report-{name}-")
    fetch_outputs(fs, root, local)
    print(f"outputs of {fs.unstrip_protocol(root)}, copied to {local}")
    for line in logger_hints(local) + earlier_copies(local):
        print(line)
    return local


def earlier_copies(local: str) -> list[str]:
    """Where the copies of earlier drivers of a continued run are, if any."""
    earlier = os.path.join(local, EARLIER_DIR)
    if not os.path.isdir(earlier):
        return []
    found = sorted(os.listdir(earlier), key=lambda n: (len(n), n))
    return [f"earlier drivers' outputs: {', '.join(os.path.join(earlier, n) for n in found)}"]


def logger_hints(local: str) -> list[str]:
    """How to open the loggers' files copied with a run's outputs."""
    hints = []
    if os.path.isdir(os.path.join(local, "logs", "tensorboard")):
        hints.append(f"TensorBoard: tensorboard --logdir {os.path.join(local, 'logs')}")
    if os.path.isdir(os.path.join(local, "mlruns")):
        hints.append(f"MLflow: mlflow ui --backend-store-uri {os.path.join(local, 'mlruns')}")
    wandb = os.path.join(local, "wandb")
    if os.path.isdir(wandb):
        for run in sorted(os.listdir(wandb)):
            hints.append(f"W&B (offline run): wandb sync {os.path.join(wandb, run)}")
    return hints


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ftjob.report",
        description="Rebuild sweep_summary.csv/.md/.png of a sweep dir (finished, partial or "
        "failed), or print the summary of a single run dir (one holding summary.json).",
    )
    parser.add_argument(
        "dir",
        help="a sweep dir (hydra.sweep.dir), a run dir, or a run in its storage "
        "(s3://bucket/path/NAME: the outputs mirrored there)",
    )
    args = parser.parse_args(argv)
    target: str = args.dir
    if "://" in target or (
        os.path.isdir(target)
        and not _is_run_dir(target)
        and _is_run_dir(os.path.join(target, "outputs"))
    ):
        try:
            local = from_storage(target)
        except (OSError, RuntimeError, ValueError, ImportError) as exc:
            print(f"ftjob.report: {target}: could not read ({exc})", file=sys.stderr)
            return 2
        if local is None:
            print(
                f"ftjob.report: {target}: no {SUMMARY_FILE} there nor in its outputs/",
                file=sys.stderr,
            )
            return 2
        target = local
    if not os.path.isdir(target):
        print(f"ftjob.report: {target}: no such directory", file=sys.stderr)
        return 2
    if _is_run_dir(target):
        return summarise_run(target)
    copied_report = os.path.join(target, SWEEP_MD)
    if not find_job_dirs(target) and os.path.isfile(copied_report):
        with open(copied_report) as f:  # a sweep's report copied to storage, without its jobs
            print(f.read().rstrip("\n"))
        return 0
    if not find_job_dirs(target):
        print(
            f"ftjob.report: {target}: neither a run dir (no {SUMMARY_FILE}) nor a sweep dir "
            f"(no job dirs with {OVERRIDES_FILE} or {SUMMARY_FILE})",
            file=sys.stderr,
        )
        return 2
    print(report_text(build_sweep_report(target)))
    return 0


def _is_run_dir(path: str) -> bool:
    """A run's dir: its summary.json, or the record a driver that did not end kept."""
    return any(os.path.isfile(os.path.join(path, f)) for f in (SUMMARY_FILE, RECORD_FILE))


if __name__ == "__main__":
    sys.exit(main())
