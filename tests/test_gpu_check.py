"""benchmarks/gpu_check.sh, the one command a session with a GPU runs: its parts fit the
device command's time, and every benchmark it names exists and takes the flags it is given --
on the GPU and in its CPU dry run. A wrong flag found here costs nothing; found there, it costs
a part of a lease that comes seldom."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
DEVICE_COMMAND_S = 600  # the most one device command may run
BUDGET_S = 470  # the parts' share: under 8 device minutes, a rerun's room left in a lease of ~15


def parts(dry: bool, only: str = "") -> list[tuple[str, str, int, list[str]]]:
    """(part | extra, name, timeout, command) of each part, as the script lists them."""
    env = {**os.environ, "GPU_CHECK_LIST": "1", "GPU_CHECK_DRY": "1" if dry else "0"}
    env["GPU_CHECK_PARTS"] = only
    done = subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, check=True, timeout=60
    )
    rows = []
    for line in done.stdout.splitlines():
        kind, name, limit, *command = line.split("\t")
        rows.append((kind, name, int(limit), command))
    return rows


@pytest.mark.parametrize("dry", [False, True], ids=["gpu", "cpu-dry-run"])
def test_the_parts_fit_the_device_command_in_order(dry):
    rows = parts(dry)
    kinds = [kind for kind, *_ in rows]
    assert set(kinds) <= {"part", "extra"} and kinds == sorted(kinds, key="part extra".index), (
        "the extras come last: they run only in the time the parts left"
    )
    total = sum(limit for kind, _, limit, _ in rows if kind == "part")
    assert total <= BUDGET_S < DEVICE_COMMAND_S, f"the parts' timeouts sum to {total} s"
    assert f"BUDGET={BUDGET_S}" in SCRIPT.read_text(), "the script caps every part by the budget"
    names = [name for _, name, _, _ in rows]
    assert names[:4] == ["env", "input", "exact", "chaos"], "the targets' parts come first"


def test_a_rerun_runs_the_parts_it_names_after_env():
    assert [name for _, name, _, _ in parts(False, "chaos exact")] == ["env", "exact", "chaos"]


def benchmark_and_flags(command: list[str]) -> tuple[Path, list[str]]:
    scripts = [w for w in command if re.fullmatch(r"benchmarks/[\w]+\.py", w)]
    assert len(scripts) == 1, f"one benchmark a part: {command}"
    after = command[command.index(scripts[0]) + 1 :]
    return REPO / scripts[0], [w for w in after if w.startswith("--")]


def test_every_benchmark_named_exists_and_takes_the_flags_it_is_given():
    wanted: dict[Path, set[str]] = {}
    for dry in (False, True):
        for _, name, _, command in parts(dry):
            script, flags = benchmark_and_flags(command)
            assert script.is_file(), f"part {name}: {script} does not exist"
            wanted.setdefault(script, set()).update(flags)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    helps = {  # each imports torch before it parses: all at once
        script: subprocess.Popen(
            [sys.executable, str(script), "--help"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for script in sorted(wanted)
    }
    for script, running in helps.items():
        out, err = running.communicate(timeout=300)
        assert running.returncode == 0, f"{script.name} --help: {err[-500:]}"
        offered = set(re.findall(r"--[\w-]+", out))
        assert wanted[script] <= offered, (
            f"{script.name} does not take {sorted(wanted[script] - offered)}"
        )


def test_the_site_archive_is_written_where_git_ignores_it():
    site = (REPO / "benchmarks" / "gpu_site.sh").read_text()
    assert "OUT_TAR=${GPU_SITE_OUT:-.gpu/site.tar.xz}" in site
    ignored = (REPO / ".gitignore").read_text().split()
    assert ".gpu/" in ignored, ".gpu/ must be in .gitignore: the archive is carried, not kept"
    assert "tar -xJf .gpu/site.tar.xz -C /tmp/site" in SCRIPT.read_text()


def test_the_chaos_parts_projection_is_the_summarys_own_model():
    """gpu_job.py projects ETTR from summary.json's figures with the first-order model that
    makes summary.json's goodput.predicted: at the run's own failures it gives that figure,
    at a failure every 480 s what predict_ettr gives for it."""
    import dataclasses

    from ftjob.reporting.goodput import predict_ettr
    from ftjob.reporting.run_summary import Buckets, Goodput

    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_job import project

    buckets = Buckets(
        training=100.0, data_wait=10.0, checkpoint=4.0, detection=2.0, restart=15.0,
        restore=0.5, setup=3.0, redone=1.0, startup=20.0, validation=2.0, shutdown=3.0,
    )  # fmt: skip
    wall = sum(buckets.seconds().values())
    goodput = Goodput(wall_s=wall, ettr=0.6, buckets=buckets, memory_snapshot_s=2.0)
    model = dict(checkpoints=10, failures=2, snapshots=300)
    ran = predict_ettr(goodput, mtbf_s=60.0, max_failures=2, **model)
    assert ran is not None
    written = {"wall_s": wall, "buckets": buckets.seconds(), "predicted": dataclasses.asdict(ran)}
    here = project(written, 60.0, expected=ran.expected_failures)
    at_480 = predict_ettr(goodput, mtbf_s=480.0, max_failures=None, **model)
    projected = project(written, 480.0)
    assert here is not None and projected is not None and at_480 is not None
    assert here[0] == pytest.approx(ran.ettr, rel=1e-12)
    assert projected[0] == pytest.approx(at_480.ettr, rel=1e-12)
    assert projected[0] < projected[1] < 1.0  # a long run amortises its start and its end
