"""Job config loading: the shipped demo loads, defaults apply, and bad input is refused by name."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from supervisor.config import (
    MAX_CONFIG_BYTES,
    ConfigError,
    JobConfig,
    RestartConfig,
    StopConfig,
    check_launchable,
    load_config,
    parse_config,
)
from supervisor.core import Policy
from supervisor.core.rollback import AnomalyPolicy
from supervisor.launch.ranks import Attempt, rank_envs
from worker.anomaly import AdaptiveConfig
from worker.contract import ENV_IN_PLACE, RunLayout, WorkerConfig
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
    assert config.restart == RestartConfig(
        max_restarts=3, backoff_initial_s=1.0, backoff_factor=2.0, backoff_max_s=30.0
    )
    assert config.stop == StopConfig(kill_grace_s=5.0, sigkill_wait_s=5.0)
    assert config.worker == WorkerConfig(
        save_checkpoint_steps=25, prefix="demo", feature_value_check=FeatureValueConfig(level=2)
    )
    assert config.worker.adaptive_spike == AdaptiveConfig(enabled=True)
    assert not config.worker.use_skip_data_by_global_norm
    assert config.anomaly == AnomalyPolicy(rollback_steps=50, skip_after_steps=100, max_tries=3)
    assert config.hang.heartbeat == "required"


def test_minimal_config_takes_defaults(tmp_path):
    """A config naming only a script gets every default."""
    config = load_config(write(tmp_path, "script: train.py\n"))
    assert config == JobConfig(script="train.py")
    assert (config.args, config.nproc_per_node, config.run_dir, config.master_addr, config.env) == (
        [],
        1,
        "runs/default",
        "127.0.0.1",
        {},
    )
    assert config.restart == RestartConfig(
        max_restarts=3, backoff_initial_s=1.0, backoff_factor=2.0, backoff_max_s=60.0
    )
    assert config.stop == StopConfig(kill_grace_s=10.0, sigkill_wait_s=5.0)
    assert config.worker == WorkerConfig(
        save_checkpoint_steps=0, prefix="ckpt", resume_training=True, heartbeat_interval_s=0.5
    )


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
    config = parse_config(
        {
            "script": "t.py",
            "nproc_per_node": 4,
            "restart": {
                "max_restarts": 7,
                "backoff_initial_s": 0.5,
                "backoff_factor": 3,
                "backoff_max_s": 9,
                "crash_loop_attempts": 5,
                "in_place_timeout_s": 4,
            },
            "stop": {"kill_grace_s": 2, "sigkill_wait_s": 1.5},
        }
    )
    assert config.policy() == Policy(
        nproc=4,
        max_restarts=7,
        backoff_initial_s=0.5,
        backoff_factor=3.0,
        backoff_max_s=9.0,
        kill_grace_s=2.0,
        sigkill_wait_s=1.5,
        crash_loop_attempts=5,
        in_place=True,
        in_place_off="",
        in_place_timeout_s=4.0,
    )


def test_recovery_in_place_is_on_by_default_across_nodes_too_and_off_by_setting():
    """The core is told whether survivors may recover in place, and if not, why (its journal says it)."""
    job = {"script": "t.py", "nproc_per_node": 2}
    assert parse_config(job).policy().in_place
    assert parse_config({**job, "nodes": 2, "spare_nodes": 1}).policy().in_place
    off = parse_config({**job, "nodes": 2, "restart": {"in_place": False}}).policy()
    assert (off.in_place, off.in_place_off) == (False, "restart.in_place is false")


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
    config = load_config(
        write(
            tmp_path,
            "script: t.py\nworker:\n  save_checkpoint_steps: 10\n  prefix: gpt\n"
            "  resume_training: false\n  heartbeat_interval_s: 1\n",
        )
    )
    assert config.worker == WorkerConfig(
        save_checkpoint_steps=10, prefix="gpt", resume_training=False, heartbeat_interval_s=1.0
    )


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
        ("nproc_per_node: 0", "'nproc_per_node' must be between 1 and 1024, got 0"),
        ("device: gpu", "'device' must be cpu or cuda, got 'gpu'"),
        ("restart: {max_restarts: -1}", "'restart.max_restarts' must be 0 or more, got -1"),
        ("restart: {crash_loop_attempts: 1}", "'restart.crash_loop_attempts' must be 0 (off) or at least 2, got 1"),
        ("restart: {backoff_factor: 0.5}", "'restart.backoff_factor' must be at least 1, got 0.5"),
        ("restart: {backoff_initial_s: -1}", "'restart.backoff_initial_s' must be 0 or more, got -1"),
        ("stop: {kill_grace_s: -0.5}", "'stop.kill_grace_s' must be 0 or more, got -0.5"),
        ("stop: {sigkill_wait_s: 0}", "'stop.sigkill_wait_s' must be more than 0, got 0"),
        ("worker: {heartbeat_interval_s: 0}", "'worker.heartbeat_interval_s' must be more than 0, got 0"),
        ("worker: {save_checkpoint_steps: -5}", "'worker.save_checkpoint_steps' must be 0 or more, got -5"),
        ("worker: {prefix: a/b}", "'worker.prefix' must be a non-empty name without '/', got 'a/b'"),
        ("worker: {prefix: ''}", "'worker.prefix' must be a non-empty name without '/', got ''"),
        ("worker: {snapshot_steps: -1}", "'worker.snapshot_steps' must be 0 or more, or auto, got -1"),
        ("worker: {snapshot_steps: often}", "'worker.snapshot_steps' must be 0 or more, or auto, got 'often'"),
        ("worker: {snapshot_steps: 2.5}", "'worker.snapshot_steps' must be 0 or more, or auto, got 2.5"),
        ("worker: {snapshot_max_bytes: -1}", "'worker.snapshot_max_bytes' must be 0 or more (0: free memory decides)"),
        (
            "worker: {load_checkpoint: /no/such/run/checkpoint}",
            "'worker.load_checkpoint' must be an existing directory (another run's checkpoint/ folder), "
            "got '/no/such/run/checkpoint'",
        ),
    ],
)
def test_out_of_bounds_value_refused(tmp_path, text, expected):
    """A value outside its field's bounds is refused naming the key, the bound and the value."""
    assert expected in refusal(tmp_path, f"script: t.py\n{text}\n")


@pytest.mark.parametrize(("value", "expected"), [("auto", "auto"), ("0", 0), ("25", 25)])
def test_snapshot_steps_takes_a_count_or_auto(value, expected):
    """`worker.snapshot_steps` is a number of steps (0: off) or `auto` (worker.cadence chooses)."""
    assert parse_config(yaml.safe_load(f"script: t.py\nworker: {{snapshot_steps: {value}}}")).worker.snapshot_steps == (
        expected
    )


def test_snapshot_max_bytes_takes_a_byte_count():
    """`worker.snapshot_max_bytes` is bytes per node, 0 by default (free memory decides)."""
    assert JobConfig().worker.snapshot_max_bytes == 0
    assert parse_config({"script": "t.py", "worker": {"snapshot_max_bytes": 2**34}}).worker.snapshot_max_bytes == 2**34


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


# ---- hostile files ------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_fifo_config_refused_without_blocking(tmp_path):
    """A FIFO given as the config is refused at once instead of waiting forever for a writer."""
    path = tmp_path / "job.yaml"
    os.mkfifo(path)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: cannot read config: not a regular file (a FIFO)"


def test_non_utf8_config_refused(tmp_path):
    """A config holding bytes that are not UTF-8 is refused naming the byte, not crashed on."""
    path = tmp_path / "job.yaml"
    path.write_bytes(b"script: t\xff.py\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: not UTF-8 text (invalid start byte at byte 9)"


def test_config_over_one_mib_refused_unread(tmp_path):
    """A config larger than MAX_CONFIG_BYTES is refused without being read whole."""
    path = write(tmp_path, "script: t.py\n#" + "x" * MAX_CONFIG_BYTES + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: cannot read config: larger than {MAX_CONFIG_BYTES} bytes"


def test_config_of_exactly_one_mib_loads(tmp_path):
    """A config of exactly MAX_CONFIG_BYTES (a long comment) still loads."""
    head = "script: t.py\n#"
    path = write(tmp_path, head + "x" * (MAX_CONFIG_BYTES - len(head) - 1) + "\n")
    assert path.stat().st_size == MAX_CONFIG_BYTES
    assert load_config(path) == JobConfig(script="t.py")


def test_symlinked_config_loads(tmp_path):
    """A config reached through a symlink is followed and loaded (configs are often linked into place)."""
    link = tmp_path / "link.yaml"
    link.symlink_to(write(tmp_path, "script: t.py\n"))
    assert load_config(link) == JobConfig(script="t.py")


def test_duplicate_key_refused_naming_it_and_its_line(tmp_path):
    """A key given twice in one mapping is refused, not silently overridden by the second."""
    message = refusal(tmp_path, "script: t.py\nrestart:\n  max_restarts: 3\nrestart:\n  max_restarts: 0\n")
    assert message.endswith(": not valid YAML: duplicate key 'restart' (line 4, column 1)")


def test_merge_key_may_be_overridden(tmp_path):
    """`<<:` merged keys given again after the merge are YAML's override, not a duplicate."""
    path = write(tmp_path, "script: t.py\nhang:\n  phase_timeouts_s:\n    <<: {train: 30, save: 60}\n    train: 10\n")
    timeouts = load_config(path).hang.phase_timeouts_s
    assert (timeouts["train"], timeouts["save"]) == (10.0, 60.0)


@pytest.mark.timeout(10)
def test_yaml_alias_bomb_refused(tmp_path):
    """A "billion laughs" document (9 aliases per level, 10 levels) is refused before anything walks it."""
    levels = [f"l0: &l0 [{', '.join(['lol'] * 9)}]"]
    levels += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 10)]
    message = refusal(tmp_path, "script: t.py\nenv:\n  " + "\n  ".join(levels) + "\n")
    assert message.endswith(f": aliases expand the document beyond {MAX_CONFIG_BYTES} bytes")


def test_alias_cycle_refused(tmp_path):
    """An alias inside its own anchor (a self-containing list) is refused."""
    assert refusal(tmp_path, "script: t.py\nargs: &a [*a]\n").endswith(": alias *a refers to a node that contains it")


@pytest.mark.timeout(10)
def test_deep_nesting_refused_quickly(tmp_path):
    """A document nested 100000 flow levels deep is refused at level 33, before the YAML scanner crawls."""
    message = refusal(tmp_path, "script: t.py\nargs: " + "[" * 100_000 + "\n")
    assert message.endswith(": nested more than 32 levels deep")


def test_modest_aliases_accepted(tmp_path):
    """Anchors, aliases and merge keys that expand the document a little are accepted."""
    config = load_config(
        write(
            tmp_path,
            "script: t.py\nargs: [--lr, &lr '0.1', --final-lr, *lr]\n"
            "hang:\n  phase_timeouts_s: {<<: &t {train: 30}, save: 60}\n",
        )
    )
    assert config.args == ["--lr", "0.1", "--final-lr", "0.1"]
    assert (config.hang.phase_timeouts_s["train"], config.hang.phase_timeouts_s["save"]) == (30.0, 60.0)


def test_yaml_error_is_one_line(tmp_path):
    """The parser's multi-line complaint is given on one line, with its line and column."""
    message = refusal(tmp_path, "script: t.py\nargs: [--steps, 5\n")
    assert "\n" not in message
    assert message.endswith("(line 3, column 1)")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("x: !!timestamp 2020-13-45", "not valid YAML: month must be in 1..12"),
        ("x: !!int abc", "not valid YAML: invalid literal for int() with base 10: 'abc'"),
        ("x: " + "9" * 5000, "not valid YAML: Exceeds the limit (4300 digits) for integer string conversion"),
    ],
)
def test_value_the_yaml_constructor_cannot_build_refused(tmp_path, text, expected):
    """A tagged or oversized scalar the YAML constructor raises ValueError on is a ConfigError."""
    assert expected in refusal(tmp_path, f"script: t.py\n{text}\n")


# ---- values that would crash or wedge the supervisor ----------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "worker: {monitor_config: {global_norm_spike_threshold: .nan}}",
            "'worker.monitor_config.global_norm_spike_threshold' must be a finite number, got nan",
        ),
        ("restart: {backoff_factor: .inf}", "'restart.backoff_factor' must be a finite number, got inf"),
        ("hang: {phase_timeouts_s: {train: -.inf}}", "'hang.phase_timeouts_s.train' must be a finite number, got -inf"),
        ("anomaly: {widen_factor: 1.0e+400}", "'anomaly.widen_factor' must be a finite number, got inf"),
        ("args: [.NaN]", "'args[0]' must be a finite number, got nan"),
    ],
)
def test_non_finite_number_refused(tmp_path, text, expected):
    """NaN and ±Infinity are refused wherever a number may go, by key name."""
    assert refusal(tmp_path, f"script: t.py\n{text}\n").endswith(expected)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "restart: {max_restarts: 1" + "0" * 400 + "}",
            "'restart.max_restarts' must be at most 2**53 in size, got an integer of 1329 bits",
        ),
        (
            "anomaly: {rollback_steps: -9007199254740993}",
            "'anomaly.rollback_steps' must be at most 2**53 in size, got -9007199254740993",
        ),
        ("args: [1" + "0" * 400 + "]", "'args[0]' must be at most 2**53 in size, got an integer of 1329 bits"),
        (
            "worker: {embedding_local_norm_threshold: 1.0e+20}",
            "'worker.embedding_local_norm_threshold' must be at most 2**53 in size, got 1e+20",
        ),
    ],
)
def test_huge_number_refused(tmp_path, text, expected):
    """Integers like 10^400 and floats beyond 2**53 are refused by key name, without printing all their digits."""
    assert refusal(tmp_path, f"script: t.py\n{text}\n").endswith(expected)


def test_largest_number_accepted(tmp_path):
    """2**53 itself is within bounds."""
    config = load_config(write(tmp_path, "script: t.py\nrestart: {max_restarts: 9007199254740992}\n"))
    assert config.restart.max_restarts == 2**53


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("stop: {timeout_s: 10000001}", "'stop.timeout_s' must be at most 10000000 seconds, got 10000001"),
        (
            "hang: {phase_timeouts_s: {train: 1.0e+8}}",
            "'hang.phase_timeouts_s.train' must be at most 10000000 seconds, got 100000000.0",
        ),
        (
            "hang: {calibration: {floor_s: 9007199254740992}}",
            "'hang.calibration.floor_s' must be at most 10000000 seconds, got 9007199254740992",
        ),
    ],
)
def test_seconds_beyond_ten_million_refused(tmp_path, text, expected):
    """Every `*_s` value is at most 10^7 s, so no deadline or queue timeout can overflow."""
    assert refusal(tmp_path, f"script: t.py\n{text}\n").endswith(expected)


def test_ten_million_seconds_accepted(tmp_path):
    """Exactly 10^7 s is within bounds."""
    assert load_config(write(tmp_path, "script: t.py\nstop: {timeout_s: 10000000}\n")).stop.timeout_s == 1e7


def test_fork_bomb_nproc_refused(tmp_path):
    """`nproc_per_node: 1000000000` is refused instead of forking a billion ranks."""
    message = refusal(tmp_path, "script: t.py\nnproc_per_node: 1000000000\n")
    assert message.endswith("'nproc_per_node' must be between 1 and 1024, got 1000000000")


def test_nproc_of_1024_accepted(tmp_path):
    """1024 ranks on one node is the largest accepted value."""
    assert load_config(write(tmp_path, "script: t.py\nnproc_per_node: 1024\n")).nproc_per_node == 1024


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('script: "t\\0.py"', "'script' must not contain a NUL character, got 't\\x00.py'"),
        ('script: t.py\nargs: [--x, "a\\0b"]', "'args[1]' must not contain a NUL character, got 'a\\x00b'"),
        ('script: t.py\nenv: {A: "\\0"}', "'env.A' must not contain a NUL character, got '\\x00'"),
        ('script: t.py\nenv: {"A\\0B": x}', "'env key A\\x00B' must not contain a NUL character, got 'A\\x00B'"),
        ('script: t.py\nrun_dir: "runs/\\0"', "'run_dir' must not contain a NUL character, got 'runs/\\x00'"),
        ('command: ["py\\0thon"]', "'command[0]' must not contain a NUL character, got 'py\\x00thon'"),
        (
            'script: t.py\nworker: {load_checkpoint: "/tmp/\\0"}',
            "'worker.load_checkpoint' must not contain a NUL character, got '/tmp/\\x00'",
        ),
    ],
)
def test_nul_byte_in_string_refused(tmp_path, text, expected):
    """A NUL character in any string (Popen and open() raise ValueError on it) is refused by key name."""
    assert refusal(tmp_path, f"{text}\n").endswith(expected)


def test_lone_surrogate_refused():
    """A string holding a lone surrogate (not encodable text) is refused by key name."""
    with pytest.raises(ConfigError) as info:
        parse_config({"script": "t.py", "args": ["\ud800"]}, source="inline")
    assert str(info.value) == "inline: 'args[0]' must be valid Unicode text, got '\\ud800'"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("env: {1: x}", "'env' keys must be strings, got 1"),
        ("env: {null: x}", "'env' keys must be strings, got None"),
        ("hang: {phase_timeouts_s: {true: 5}}", "'hang.phase_timeouts_s' keys must be strings, got True"),
        ('env: {"A=B": x}', "'env' must be a mapping of variable names (non-empty, no '='), got {'A=B': 'x'}"),
        ('env: {"": x}', "'env' must be a mapping of variable names (non-empty, no '='), got {'': 'x'}"),
    ],
)
def test_bad_mapping_key_refused(tmp_path, text, expected):
    """Mapping keys that are not names (numbers, null, booleans, `A=B`, empty) are refused by key name."""
    assert refusal(tmp_path, f"script: t.py\n{text}\n").endswith(expected)


def test_unknown_key_with_newline_is_shown_escaped(tmp_path):
    """An unknown key holding a newline is named escaped, so the message stays on one line."""
    message = refusal(tmp_path, 'script: t.py\n"a\\nb": 1\n')
    assert "unknown key 'a\\nb' (known keys: " in message
    assert "\n" not in message


def test_resume_step_of_5000_digits_refused(tmp_path):
    """A resume_training step too long to be a number is refused like any other bad checkpoint name."""
    message = refusal(tmp_path, f"script: t.py\nworker: {{resume_training: '{'9' * 5000}'}}\n")
    assert "'worker.resume_training' must be true, false, or a checkpoint name such as " in message
    assert message.endswith("...")


def test_load_checkpoint_path_too_long_refused(tmp_path):
    """A load_checkpoint path too long to stat is refused as not an existing directory."""
    message = refusal(tmp_path, f"script: t.py\nworker: {{load_checkpoint: /{'a' * 5000}}}\n")
    assert "'worker.load_checkpoint' must be an existing directory (another run's checkpoint/ folder)" in message


# ---- can the run be launched? -------------------------------------------------------------------


def test_missing_absolute_script_refused(tmp_path):
    """A script path that does not exist is refused once, naming it."""
    config = parse_config({"script": str(tmp_path / "nope.py")})
    with pytest.raises(ConfigError) as info:
        check_launchable(config, tmp_path)
    assert str(info.value) == f"{tmp_path / 'nope.py'} not found"


def test_relative_script_resolved_against_cwd(tmp_path, monkeypatch):
    """A relative script path is taken from the working directory and handed on absolute; the rest is kept."""
    (tmp_path / "train.py").write_text("pass\n")
    monkeypatch.chdir(tmp_path)
    config = parse_config({"script": "train.py", "args": ["--steps", 5]})
    assert check_launchable(config) == replace(config, script=str(tmp_path / "train.py"))


def test_missing_relative_script_names_the_working_directory(tmp_path):
    """A missing relative script is refused naming the working directory it was looked up in."""
    with pytest.raises(ConfigError) as info:
        check_launchable(parse_config({"script": "missing.py"}), tmp_path)
    assert str(info.value) == f"missing.py not found (relative paths are taken from the working directory {tmp_path})"


def test_directory_as_script_refused(tmp_path):
    """A directory given as the script is refused as not a regular file."""
    (tmp_path / "train").mkdir()
    with pytest.raises(ConfigError) as info:
        check_launchable(parse_config({"script": "train"}), tmp_path)
    assert str(info.value) == (
        f"train is not a regular file (relative paths are taken from the working directory {tmp_path})"
    )


def test_command_program_missing_from_path_refused(tmp_path):
    """A command whose program is on no directory of the ranks' PATH is refused naming it."""
    config = parse_config({"command": ["no-such-trainer", "--x"], "env": {"PATH": str(tmp_path)}})
    with pytest.raises(ConfigError) as info:
        check_launchable(config, tmp_path)
    assert str(info.value) == "no-such-trainer not found on PATH"


def test_command_program_found_on_the_ranks_path_accepted(tmp_path):
    """A command whose program is on the PATH given in `env:` is accepted unchanged."""
    program = tmp_path / "bin" / "trainer"
    program.parent.mkdir()
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    config = parse_config({"command": ["trainer"], "env": {"PATH": str(program.parent)}})
    assert check_launchable(config, tmp_path) == config


@pytest.mark.parametrize(("mode", "problem"), [(None, "not found"), (0o644, "is not executable")])
def test_command_program_path_must_be_an_executable_file(tmp_path, mode, problem):
    """A command program given as a relative path must exist and be executable."""
    if mode is not None:
        (tmp_path / "run.sh").write_text("#!/bin/sh\n")
        (tmp_path / "run.sh").chmod(mode)
    with pytest.raises(ConfigError) as info:
        check_launchable(parse_config({"command": ["./run.sh"]}), tmp_path)
    assert str(info.value) == f"./run.sh {problem} (relative paths are taken from the working directory {tmp_path})"


# ---- the command line -------------------------------------------------------------------------


def trainwarden_run(config: Path, run_dir: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", "run", str(config), "--run-dir", str(run_dir)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_fifo_config_exits_78_and_launches_nothing(tmp_path):
    """`trainwarden run FIFO` exits 78 at once with a one-line message, and creates no run dir."""
    config = tmp_path / "job.yaml"
    os.mkfifo(config)
    done = trainwarden_run(config, tmp_path / "run", tmp_path)
    assert (done.returncode, done.stdout) == (78, "")
    assert done.stderr == f"trainwarden: config error: {config}: cannot read config: not a regular file (a FIFO)\n"
    assert not (tmp_path / "run").exists()


def test_cli_missing_script_exits_78_and_launches_nothing(tmp_path):
    """`trainwarden run` with a missing relative script exits 78 naming the working directory, launching nothing."""
    config = write(tmp_path, "script: missing.py\nnproc_per_node: 2\n")
    done = trainwarden_run(config, tmp_path / "run", tmp_path)
    assert (done.returncode, done.stdout) == (78, "")
    assert done.stderr == (
        "trainwarden: cannot launch: missing.py not found (relative paths are taken from the "
        f"working directory {tmp_path})\n"
    )
    assert not (tmp_path / "run").exists()


def test_multi_node_keys_set_the_world_size_and_the_slurm_section(tmp_path):
    config = load_config(
        write(
            tmp_path,
            "script: t.py\nnodes: 3\nnproc_per_node: 4\nspare_nodes: 1\n"
            "slurm: {node_timeout_s: 5, max_node_failures: 1, srun_args: [--gpus=8]}\n",
        )
    )
    assert (config.world_size, config.policy().nproc, config.spare_nodes) == (12, 12, 1)
    assert (config.slurm.node_timeout_s, config.slurm.max_node_failures, config.slurm.srun_args) == (5, 1, ["--gpus=8"])
    assert load_config(write(tmp_path, "script: t.py\n")).world_size == 1  # one node unless asked
    assert load_config(write(tmp_path, "script: t.py\n")).slurm.controller_wait_s == 300


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("nodes: 0", "'nodes' must be between 1 and 4096"),
        ("spare_nodes: -1", "'spare_nodes' must be between 0 and 4096"),
        ("slurm: {node_timeout_s: 1}", "'slurm.node_timeout_s' must be at least 2"),
        ("slurm: {max_node_failures: 0}", "'slurm.max_node_failures' must be at least 1"),
        ("slurm: {node_timout_s: 5}", "did you mean 'node_timeout_s'"),
        ("slurm: {controller_wait_s: -1}", "'slurm.controller_wait_s' must be 0 or more"),
    ],
)
def test_bad_multi_node_keys_are_refused_by_name(tmp_path, text, named):
    assert named in refusal(tmp_path, f"script: t.py\n{text}\n")


def test_a_multi_node_config_outside_slurm_is_refused_before_anything_starts(tmp_path):
    (tmp_path / "t.py").write_text("")
    config = write(tmp_path, f"script: {tmp_path / 't.py'}\nnodes: 2\nrun_dir: {tmp_path / 'run'}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "run", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 78
    assert "nodes: 2 needs a Slurm allocation: run it inside sbatch or salloc" in done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ({"slurm": {"min_nodes": 3}}, "'slurm.min_nodes' (3) must be between 1 and 'nodes' (2)"),
        ({"slurm": {"min_nodes": 1}}, "'slurm.min_nodes' below 'nodes' needs 'worker.checkpoint_format: dcp'"),
    ],
)
def test_min_nodes_is_a_node_count_the_run_has_and_needs_sharded_checkpoints(tmp_path, extra, said):
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"command": ["true"], "nodes": 2, **extra}))
    with pytest.raises(ConfigError, match=re.escape(said)):
        load_config(config)
    config.write_text(
        yaml.safe_dump(
            {"command": ["true"], "nodes": 2, "slurm": {"min_nodes": 1}, "worker": {"checkpoint_format": "dcp"}}
        )
    )
    assert load_config(config).min_nodes == 1


def test_ranks_are_told_to_recover_in_place_and_nccl_to_let_them_live(tmp_path: Path) -> None:
    """On by default: TRAINWARDEN_IN_PLACE=1 (worker.run acts on it) and NCCL's error handling aborts the
    communicator without ending the process (2); off, or across nodes: neither (3 ends the process)."""
    layout = RunLayout(tmp_path)
    on = parse_config({"script": "t.py", "nproc_per_node": 2})
    off = parse_config({"script": "t.py", "nproc_per_node": 2, "restart": {"in_place": False}})
    told = {name: rank_envs(config, layout, Attempt(0), port=29500)[1] for name, config in (("on", on), ("off", off))}
    if "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ:  # this machine's own setting wins
        assert (told["on"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"], told["off"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"]) == (
            "2",
            "3",
        )
    assert (told["on"][ENV_IN_PLACE], told["off"][ENV_IN_PLACE]) == ("1", "")
