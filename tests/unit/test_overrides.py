"""`--set KEY=VALUE` overrides: set into the parsed YAML before validation, validated like the file, blamed by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.config import ConfigError, apply_overrides, load_config, parse_config

REPO = Path(__file__).resolve().parents[2]
JOB = {"script": "t.py", "worker": {"prefix": "demo", "save_checkpoint_steps": 25}}


def refusal(raw: dict, *overrides: str) -> str:
    """The ConfigError message for `raw` with `overrides` applied."""
    with pytest.raises(ConfigError) as info:
        parse_config(raw, source="job.yaml", overrides=overrides)
    return str(info.value)


def test_an_override_sets_a_nested_key_and_keeps_its_siblings():
    """`worker.save_checkpoint_steps=100` replaces that key only; the file's other worker keys stay."""
    config = parse_config(JOB, overrides=["worker.save_checkpoint_steps=100", "restart.max_restarts=5"])
    assert (config.worker.save_checkpoint_steps, config.worker.prefix, config.restart.max_restarts) == (100, "demo", 5)


def test_apply_overrides_leaves_the_parsed_document_unchanged():
    """The document passed in is not modified; the result is a new one with the override set."""
    result = apply_overrides(JOB, ["worker.prefix=x"])
    assert result == {"script": "t.py", "worker": {"prefix": "x", "save_checkpoint_steps": 25}}
    assert JOB == {"script": "t.py", "worker": {"prefix": "demo", "save_checkpoint_steps": 25}}


def test_an_override_creates_a_section_the_file_lacks():
    """`worker.prefix=x` on a file without `worker:` (or with an empty one) creates the section."""
    assert parse_config({"script": "t.py"}, overrides=["worker.prefix=x"]).worker.prefix == "x"
    assert parse_config({"script": "t.py", "worker": None}, overrides=["worker.prefix=x"]).worker.prefix == "x"
    assert apply_overrides(None, ["script=t.py"]) == {"script": "t.py"}


@pytest.mark.parametrize(
    ("override", "key", "value"),
    [
        ("worker.resume_training=false", "resume_training", False),
        ("worker.resume_training='40'", "resume_training", "40"),
        ("worker.load_checkpoint=null", "load_checkpoint", None),
        ("worker.heartbeat_interval_s=2", "heartbeat_interval_s", 2.0),
    ],
)
def test_scalar_values_are_yaml(override, key, value):
    """VALUE is read as a YAML scalar: booleans, quoted strings, null, numbers."""
    assert getattr(parse_config({"script": "t.py"}, overrides=[override]).worker, key) == value


def test_flow_values_and_a_value_holding_equals_signs():
    """`[--lr, 0.1]` is a list, `{level: 0}` a mapping; everything after the first `=` is the value (`a=b`)."""
    config = parse_config(
        {"script": "t.py"}, overrides=["args=[--lr, 0.1]", "env.OPTS=a=b", "worker.feature_value_check={level: 0}"]
    )
    assert (config.args, config.env, config.worker.feature_value_check.level) == (["--lr", "0.1"], {"OPTS": "a=b"}, 0)


def test_the_last_override_of_a_key_wins():
    """Overrides apply in order: the later of two for one key is the one kept."""
    assert parse_config(JOB, overrides=["worker.prefix=a", "worker.prefix=b"]).worker.prefix == "b"


def test_an_unknown_key_is_refused_naming_the_override():
    """A misspelt key gets the file's "did you mean" message, naming the override instead of the file."""
    assert refusal(JOB, "worker.save_checkpoint_stepz=1") == (
        "--set worker.save_checkpoint_stepz=1: unknown key 'worker.save_checkpoint_stepz' "
        "(did you mean 'save_checkpoint_steps'?)"
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("worker.save_checkpoint_steps=abc", "'worker.save_checkpoint_steps' must be an integer, got 'abc'"),
        ("worker.save_checkpoint_steps=-1", "'worker.save_checkpoint_steps' must be 0 or more, got -1"),
        ("restart.backoff_max_s=.inf", "'restart.backoff_max_s' must be a finite number, got inf"),
        ("hang.phase_timeouts_s.train=0", "'hang.phase_timeouts_s' must be a mapping of phases to seconds > 0"),
        ("worker.adaptive_spike.window=8", "'worker.adaptive_spike.window' (8) must be at least"),
        ("script=null", "give exactly one of 'script' (a Python file) or 'command' (a list)"),
        ("worker=5", "worker must be a mapping of keys to values, got 5"),
    ],
)
def test_a_bad_value_is_refused_as_in_the_file_naming_the_override(override, message):
    """Types, bounds and the cross-key checks apply to an override as to the file; the error names the override."""
    assert refusal(JOB, override).startswith(f"--set {override}: {message}")


def test_an_error_in_the_file_still_names_the_file():
    """An override of one key does not take the blame for another key the file got wrong."""
    raw = {"script": "t.py", "worker": {"save_checkpoint_stepz": 1}}
    assert refusal(raw, "worker.prefix=x").startswith("job.yaml: unknown key 'worker.save_checkpoint_stepz'")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("restart.max_restarts", "not KEY=VALUE (e.g. --set worker.save_checkpoint_steps=100)"),
        ("=5", "KEY must be a dotted path of names (e.g. restart.max_restarts)"),
        ("worker..prefix=x", "KEY must be a dotted path of names (e.g. restart.max_restarts)"),
        ("worker.=x", "KEY must be a dotted path of names (e.g. restart.max_restarts)"),
        ("args=[a", "not valid YAML: "),
        ("worker.prefix.x=1", "'worker.prefix' is 'demo' in the config, not a section"),
    ],
)
def test_a_malformed_override_is_refused_by_itself(override, message):
    """A `--set` without `=`, with an empty key part, an unparsable value or a path through a scalar is refused."""
    assert refusal(JOB, override).startswith(f"--set {override}: {message}")


def test_load_config_applies_overrides_to_the_file(tmp_path):
    """`load_config(path, overrides)` validates the file with the overrides set."""
    path = tmp_path / "job.yaml"
    path.write_text("script: t.py\nworker: {prefix: demo}\n")
    assert load_config(path, ["worker.prefix=other"]).worker.prefix == "other"


def test_cli_bad_override_exits_78_and_launches_nothing(tmp_path):
    """`trainwarden run job.yaml --set worker.save_checkpoint_stepz=1` exits 78 with one line; no run dir is made."""
    config = tmp_path / "job.yaml"
    config.write_text(f"script: t.py\nrun_dir: {tmp_path / 'run'}\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "supervisor",
            "run",
            str(config),
            "--set",
            "worker.prefix=ok",
            "--set",
            "worker.save_checkpoint_stepz=1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (78, "")
    assert done.stderr == (
        "trainwarden: config error: --set worker.save_checkpoint_stepz=1: unknown key "
        "'worker.save_checkpoint_stepz' (did you mean 'save_checkpoint_steps'?)\n"
    )
    assert not (tmp_path / "run").exists()
