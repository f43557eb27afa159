"""Job config loading: the shipped demo loads, defaults apply, and bad input is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.config import ConfigError, JobConfig, RestartConfig, StopConfig, load_config, parse_config
from supervisor.core import Policy
from supervisor.rollback import AnomalyPolicy
from worker.anomaly import AdaptiveConfig
from worker.contract import WorkerConfig
from worker.feature_rule import FeatureValueConfig

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def refusal(tmp_path: Path, text: str) -> str:
    """The ConfigError message for a config file holding `text`; the message must start with the file name."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    return message


# ---- valid configs ----------------------------------------------------------------------------


def test_demo_config_loads():
    """The shipped configs/demo.yaml loads into the values it spells out."""
    config = load_config(REPO / "configs" / "demo.yaml")
    assert config.script == "examples/demo_train.py"
    assert config.command is None
    assert config.args == ["--steps", "600"]
    assert config.nproc_per_node == 2
    assert config.run_dir == "runs/demo"
    assert config.env == {"OMP_NUM_THREADS": "1"}
    assert config.restart == RestartConfig(max_restarts=3, backoff_initial_s=1.0, backoff_factor=2.0,
                                           backoff_max_s=30.0)
    assert config.stop == StopConfig(kill_grace_s=5.0, sigkill_wait_s=5.0)
    assert config.worker == WorkerConfig(save_checkpoint_steps=25, prefix="demo", use_skip_data_by_global_norm=True,
                                         adaptive_spike=AdaptiveConfig(enabled=True),
                                         feature_value_check=FeatureValueConfig(level=2))
    assert config.anomaly == AnomalyPolicy(rollback_steps=50, skip_after_steps=100, max_tries=3)
    assert config.hang.heartbeat == "required"


def test_minimal_config_takes_defaults(tmp_path):
    """A config naming only a script gets every default."""
    config = load_config(write(tmp_path, "script: train.py\n"))
    assert config == JobConfig(script="train.py")
    assert (config.args, config.nproc_per_node, config.run_dir, config.master_addr, config.env) == (
        [], 1, "runs/default", "127.0.0.1", {})
    assert config.restart == RestartConfig(max_restarts=3, backoff_initial_s=1.0, backoff_factor=2.0,
                                           backoff_max_s=60.0)
    assert config.stop == StopConfig(kill_grace_s=10.0, sigkill_wait_s=5.0)
    assert config.worker == WorkerConfig(save_checkpoint_steps=0, prefix="ckpt", resume_training=True,
                                         heartbeat_interval_s=0.5)


def test_command_config_accepted(tmp_path):
    """A config with a command list instead of a script is accepted."""
    config = load_config(write(tmp_path, "command: [python, -c, pass]\n"))
    assert config.command == ["python", "-c", "pass"]
    assert config.script is None


def test_null_script_counts_as_absent(tmp_path):
    """`script: null` next to a command is the same as no script."""
    config = load_config(write(tmp_path, "script: null\ncommand: [./run.sh]\n"))
    assert (config.script, config.command) == (None, ["./run.sh"])


def test_policy_carries_restart_and_stop_knobs():
    """`JobConfig.policy()` hands every restart and stop knob to the core."""
    config = parse_config({
        "script": "t.py", "nproc_per_node": 4,
        "restart": {"max_restarts": 7, "backoff_initial_s": 0.5, "backoff_factor": 3, "backoff_max_s": 9},
        "stop": {"kill_grace_s": 2, "sigkill_wait_s": 1.5},
    })
    assert config.policy() == Policy(nproc=4, max_restarts=7, backoff_initial_s=0.5, backoff_factor=3.0,
                                     backoff_max_s=9.0, kill_grace_s=2.0, sigkill_wait_s=1.5)


def test_ints_accepted_for_float_fields(tmp_path):
    """An integer given for a float field is accepted and stored as a float."""
    config = load_config(write(tmp_path, "script: t.py\nrestart: {backoff_initial_s: 2}\nstop: {kill_grace_s: 0}\n"))
    assert config.restart.backoff_initial_s == 2.0
    assert isinstance(config.restart.backoff_initial_s, float)
    assert config.stop.kill_grace_s == 0.0
    assert isinstance(config.stop.kill_grace_s, float)


def test_args_and_env_scalars_become_strings(tmp_path):
    """Numbers in `args` and `env` values are turned into the strings a command line and environment need."""
    config = load_config(write(tmp_path, "script: t.py\nargs: [--steps, 5, 0.5]\nenv: {OMP_NUM_THREADS: 1}\n"))
    assert config.args == ["--steps", "5", "0.5"]
    assert config.env == {"OMP_NUM_THREADS": "1"}


def test_worker_section_parsed(tmp_path):
    """The `worker:` section becomes the WorkerConfig handed to the ranks."""
    config = load_config(write(tmp_path, "script: t.py\nworker:\n  save_checkpoint_steps: 10\n  prefix: gpt\n"
                                         "  resume_training: false\n  heartbeat_interval_s: 1\n"))
    assert config.worker == WorkerConfig(save_checkpoint_steps=10, prefix="gpt", resume_training=False,
                                         heartbeat_interval_s=1.0)


# ---- unknown keys -----------------------------------------------------------------------------


def test_unknown_top_level_key_refused_with_suggestion(tmp_path):
    """A misspelt top-level key is refused by name with the close known key suggested."""
    message = refusal(tmp_path, "script: t.py\nnproc_per_nod: 2\n")
    assert "unknown key 'nproc_per_nod'" in message
    assert "(did you mean 'nproc_per_node'?)" in message


def test_unknown_nested_key_refused_with_dotted_name_and_suggestion(tmp_path):
    """A misspelt nested key is refused by its dotted name with the close known key suggested."""
    message = refusal(tmp_path, "script: t.py\nrestart:\n  max_restart: 5\n")
    assert "unknown key 'restart.max_restart'" in message
    assert "(did you mean 'max_restarts'?)" in message


def test_unknown_key_without_close_match_lists_known_keys(tmp_path):
    """An unknown key resembling nothing is refused with the list of known keys of its section."""
    message = refusal(tmp_path, "script: t.py\nstop:\n  zzz: 1\n")
    assert "unknown key 'stop.zzz' (known keys: kill_grace_s, sigkill_wait_s, stop_file_path, timeout_s)" in message


def test_unknown_worker_key_refused(tmp_path):
    """An unknown key in the `worker:` section is refused by its dotted name."""
    message = refusal(tmp_path, "script: t.py\nworker:\n  save_checkpoint_step: 5\n")
    assert "unknown key 'worker.save_checkpoint_step'" in message
    assert "(did you mean 'save_checkpoint_steps'?)" in message


# ---- wrong types ------------------------------------------------------------------------------


def test_string_for_int_refused(tmp_path):
    """A quoted number for an integer field is refused by key name."""
    message = refusal(tmp_path, "script: t.py\nnproc_per_node: '2'\n")
    assert "'nproc_per_node' must be an integer, got '2'" in message


def test_bool_for_int_refused(tmp_path):
    """A boolean for an integer field is refused by dotted key name (bool is not an int here)."""
    message = refusal(tmp_path, "script: t.py\nrestart:\n  max_restarts: true\n")
    assert "'restart.max_restarts' must be an integer, got True" in message


def test_float_for_int_refused(tmp_path):
    """A fractional number for an integer field is refused by key name."""
    message = refusal(tmp_path, "script: t.py\nnproc_per_node: 2.5\n")
    assert "'nproc_per_node' must be an integer, got 2.5" in message


def test_bool_for_float_refused(tmp_path):
    """A boolean for a float field is refused by dotted key name."""
    message = refusal(tmp_path, "script: t.py\nstop:\n  kill_grace_s: yes\n")
    assert "'stop.kill_grace_s' must be a number, got True" in message


def test_number_for_string_refused(tmp_path):
    """A number for a string field is refused by key name."""
    message = refusal(tmp_path, "script: 5\n")
    assert "'script' must be a string, got 5" in message


def test_list_where_mapping_expected_refused(tmp_path):
    """A list given for a config section is refused naming the section."""
    message = refusal(tmp_path, "script: t.py\nrestart: [1, 2]\n")
    assert "restart must be a mapping of keys to values, got a list" in message


def test_null_section_refused(tmp_path):
    """An empty (null) config section is refused naming the section."""
    message = refusal(tmp_path, "script: t.py\nworker:\n")
    assert "worker must be a mapping of keys to values, got None" in message


def test_env_list_refused(tmp_path):
    """A list given for `env` is refused by key name."""
    message = refusal(tmp_path, "script: t.py\nenv: [OMP_NUM_THREADS]\n")
    assert "'env' must be a mapping, got a list" in message


def test_non_list_args_refused(tmp_path):
    """A single string given for `args` is refused by key name."""
    message = refusal(tmp_path, "script: t.py\nargs: --steps 5\n")
    assert "'args' must be a list of strings, got '--steps 5'" in message


def test_nested_list_in_args_refused(tmp_path):
    """A list inside `args` is refused by key name."""
    message = refusal(tmp_path, "script: t.py\nargs: [[--steps, 5]]\n")
    assert "'args[0]' must be a string, got a list" in message


def test_top_level_list_refused(tmp_path):
    """A YAML document that is a list, not a mapping, is refused."""
    message = refusal(tmp_path, "- script\n- t.py\n")
    assert "the top level must be a mapping of keys to values, got a list" in message


# ---- bounds -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("nproc_per_node: 0", "'nproc_per_node' must be at least 1, got 0"),
        ("restart: {max_restarts: -1}", "'restart.max_restarts' must be 0 or more, got -1"),
        ("restart: {backoff_factor: 0.5}", "'restart.backoff_factor' must be at least 1, got 0.5"),
        ("restart: {backoff_initial_s: -1}", "'restart.backoff_initial_s' must be 0 or more, got -1"),
        ("stop: {kill_grace_s: -0.5}", "'stop.kill_grace_s' must be 0 or more, got -0.5"),
        ("stop: {sigkill_wait_s: 0}", "'stop.sigkill_wait_s' must be more than 0, got 0"),
        ("worker: {heartbeat_interval_s: 0}", "'worker.heartbeat_interval_s' must be more than 0, got 0"),
        ("worker: {save_checkpoint_steps: -5}", "'worker.save_checkpoint_steps' must be 0 or more, got -5"),
        ("worker: {prefix: a/b}", "'worker.prefix' must be a non-empty name without '/', got 'a/b'"),
        ("worker: {prefix: ''}", "'worker.prefix' must be a non-empty name without '/', got ''"),
        ("worker: {snapshot_steps: -1}", "'worker.snapshot_steps' must be 0 or more, got -1"),
        ("worker: {load_checkpoint: /no/such/run/checkpoint}",
         "'worker.load_checkpoint' must be an existing directory (another run's checkpoint/ folder), "
         "got '/no/such/run/checkpoint'"),
    ],
)
def test_out_of_bounds_value_refused(tmp_path, text, expected):
    """A value outside its field's bounds is refused naming the key, the bound and the value."""
    assert expected in refusal(tmp_path, f"script: t.py\n{text}\n")


# ---- script / command ---------------------------------------------------------------------------


def test_both_script_and_command_refused(tmp_path):
    """A config with both `script` and `command` is refused."""
    message = refusal(tmp_path, "script: t.py\ncommand: [python, t.py]\n")
    assert "give exactly one of 'script' (a Python file) or 'command' (a list)" in message


def test_neither_script_nor_command_refused(tmp_path):
    """A config with neither `script` nor `command` is refused."""
    message = refusal(tmp_path, "nproc_per_node: 2\n")
    assert "give exactly one of 'script' (a Python file) or 'command' (a list)" in message


def test_empty_command_refused(tmp_path):
    """An empty `command` list is refused."""
    assert "'command' must not be empty" in refusal(tmp_path, "command: []\n")


# ---- unreadable files -------------------------------------------------------------------------


def test_malformed_yaml_refused_naming_file(tmp_path):
    """A file that is not valid YAML is refused with the file name and the parser's complaint."""
    assert "not valid YAML" in refusal(tmp_path, "script: t.py\nargs: [--steps, 5\n")


def test_missing_file_refused(tmp_path):
    """A config path that does not exist is refused naming it."""
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: cannot read config: ")


def test_empty_file_refused_for_missing_script(tmp_path):
    """An empty file parses as an empty config and is refused for lacking a script or command."""
    assert "give exactly one of 'script'" in refusal(tmp_path, "")


def test_parse_config_names_its_source():
    """`parse_config` errors start with the given source name."""
    with pytest.raises(ConfigError) as info:
        parse_config({"script": "t.py", "nprocs": 2}, source="inline")
    assert str(info.value).startswith("inline: unknown key 'nprocs'")
