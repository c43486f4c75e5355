"""The ``resume`` key: false | true | auto. OmegaConf 2.3 types no union of a bool and a word,
so the schema leaves it untyped and the job reads it: true and false as OmegaConf reads a bool,
in YAML and on the command line, as they always were; auto; anything else refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.core.global_hydra import GlobalHydra

from ftjob.cli.main import precheck
from ftjob.config import ConfigError, load_job, register_schema, to_plain
from ftjob.config.compose import Composer, Target
from tests.support.jobs import compose_job


@pytest.fixture(autouse=True)
def _schema():
    register_schema()
    yield
    GlobalHydra.instance().clear()


def from_yaml(config_dir: Path, body: str) -> object:
    """The job of a primary config in the user's config dir, holding ``body``."""
    (config_dir / "mine.yaml").write_text(f"defaults:\n  - config\n  - _self_\n{body}")
    target = Target("mine.yaml", config_name="mine", user_primary=True)
    try:
        return load_job(Composer(str(config_dir)).compose(target, []))
    finally:
        GlobalHydra.instance().clear()


@pytest.mark.parametrize(
    "given, held",
    [("resume=true", True), ("resume=false", False), ("resume=auto", "auto")],
)
def test_resume_on_the_command_line(given: str, held: object):
    job = compose_job("+experiment=digits_ft", "name=r", given)
    assert job.resume == held and type(job.resume) is type(held)
    assert to_plain(job)["resume"] == held  # what summary.json's config records


@pytest.mark.parametrize(
    "written, held", [("true", True), ("false", False), ("yes", True), ("auto", "auto")]
)
def test_resume_in_yaml(tmp_path: Path, written: str, held: object):
    job = from_yaml(tmp_path, f"name: r\nresume: {written}\n")
    assert job.resume == held and type(job.resume) is type(held)


def test_resume_is_false_by_default():
    assert compose_job().resume is False


@pytest.mark.parametrize("given", ["resume=maybe", "resume=AUTO", "resume=null", "resume=[1]"])
def test_any_other_resume_is_refused_in_one_line_with_the_words_it_takes(given: str):
    with pytest.raises(ConfigError) as err:
        compose_job("+experiment=digits_ft", "name=r", given)
    assert err.value.key == "resume"
    said = str(err.value)
    assert "\n" not in said and said.startswith("resume=")
    assert "must be false (start a new run), true (continue the run called `name`) or auto" in said


def test_a_bad_resume_is_refused_by_the_cli_check_before_ray():
    with pytest.raises(ConfigError, match=r"^resume='maybe': must be false"):
        precheck(["+experiment=digits_ft", "name=r", "resume=maybe"])


def test_resume_auto_and_true_need_a_name():
    with pytest.raises(ConfigError) as err:
        compose_job("+experiment=digits_ft", "resume=auto")
    assert str(err.value) == (
        "resume='auto': resume=auto continues the run called `name` when its storage holds a "
        "committed checkpoint, and starts it otherwise: set name=RUN_NAME too, a name that "
        "stays the same when a scheduler reruns the job"
    )
    with pytest.raises(ConfigError, match="resume=true continues the run called `name`"):
        compose_job("+experiment=digits_ft", "resume=true")
