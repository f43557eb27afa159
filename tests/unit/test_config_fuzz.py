"""Property-based fuzzing of the job config loader: whatever a config holds, loading gives a JobConfig whose
numbers are finite and bounded, or a ConfigError, and never lets another exception escape."""

from __future__ import annotations

import dataclasses
import math
import tempfile
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.config import MAX_NUMBER, MAX_SECONDS, ConfigError, JobConfig, load_config, parse_config

# A fixed budget per property, so the whole file runs in seconds, the same examples every time.
FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _key_names(cls: type) -> set[str]:
    """Every field name of a config dataclass and the dataclasses nested in it."""
    names = set()
    for f in dataclasses.fields(cls):
        names.add(f.name)
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            names |= _key_names(hint)
    return names


KEYS = sorted(_key_names(JobConfig) | {"train", "save", "startup", "PATH", "<<"})
HOSTILE = st.sampled_from(
    [
        10**400,
        -(10**400),
        2**53 + 1,
        -(2**53) - 1,
        10**7 + 1,
        1e308,
        -0.0,
        2**63,
        "\x00",
        "a\x00b",
        "\ud800",
        "",
        "a=b",
        "/",
        "9" * 5000,
        "²",
        "x" * 300,
        "/" + "a" * 5000,
    ]
)
SCALARS = (
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12) | HOSTILE | st.sampled_from(KEYS)
)
NESTED = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(KEYS) | SCALARS, inner, max_size=5),
    max_leaves=30,
)
# Mostly real keys at the top, so that the sections and their fields get reached.
DOCUMENTS = (
    st.dictionaries(st.sampled_from(KEYS), NESTED, max_size=6)
    | st.dictionaries(st.sampled_from(KEYS), NESTED, max_size=6).map(lambda d: {"script": "t.py", **d})
    | NESTED
)

YAML_PIECES = st.sampled_from(
    [
        "script: t.py\n",
        "command: [sh]\n",
        "worker:\n  ",
        "hang:\n  ",
        "env: {",
        "args: [",
        "&a ",
        "*a",
        "<<: *a",
        "[",
        "]",
        "{",
        "}",
        ": ",
        ", ",
        "- ",
        "\n",
        "  ",
        ".nan",
        ".inf",
        "1" + "0" * 400,
        "!!timestamp 2020-13-45",
        "!!binary x",
        "!!set {a}",
        '"\\0"',
        '"\\ud800"',
        "? ",
        "|\n  ",
        "---\n",
        "%YAML 1.1\n",
        "\t",
        "#",
    ]
) | st.sampled_from(KEYS)
YAML_TEXT = st.lists(YAML_PIECES | st.text(max_size=6), max_size=40).map("".join)
FILE_CONTENTS = (
    YAML_TEXT.map(str.encode)
    | st.binary(max_size=300)
    | YAML_TEXT.map(lambda t: t.encode("utf-8", errors="surrogatepass"))
)


def _numbers(value: Any) -> Iterator[tuple[str, float]]:
    """Every number inside a (nested) config value, with the dotted name it sits under."""
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from ((f"{key}.{name}", n) for name, n in _numbers(inner))
    elif isinstance(value, list):
        for inner in value:
            yield from _numbers(inner)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield "", value


def _assert_sane(config: JobConfig) -> None:
    """What every accepted config promises: finite numbers within MAX_NUMBER, `*_s` within MAX_SECONDS, no NUL."""
    for name, number in _numbers(config):
        assert math.isfinite(number) and abs(number) <= MAX_NUMBER, (name, number)
        if any(part.endswith("_s") for part in name.split(".")):
            assert number <= MAX_SECONDS, (name, number)
    assert 1 <= config.nproc_per_node <= 1024
    strings = [config.script or "", *(config.command or []), *config.args, *config.env, *config.env.values()]
    assert all("\x00" not in s for s in strings)
    config.policy()
    config.worker.to_env()


@FUZZ
@given(raw=DOCUMENTS)
def test_parse_config_gives_a_sane_config_or_config_error(raw: Any) -> None:
    """Any nested YAML-like value parses into a sane JobConfig or raises ConfigError, nothing else."""
    try:
        config = parse_config(raw, source="fuzz")
    except ConfigError as exc:
        assert str(exc).startswith("fuzz: ") and "\n" not in str(exc)
        return
    _assert_sane(config)


@pytest.fixture
def config_file() -> Iterator[Path]:
    """One file, rewritten by each example (hypothesis reuses the fixture)."""
    with tempfile.TemporaryDirectory(prefix="tw-config-fuzz-") as directory:
        yield Path(directory) / "job.yaml"


@FUZZ
@given(data=FILE_CONTENTS)
def test_load_config_gives_a_sane_config_or_config_error(config_file: Path, data: bytes) -> None:
    """Any bytes in a config file load into a sane JobConfig or raise a one-line ConfigError naming the file."""
    config_file.write_bytes(data)
    try:
        config = load_config(config_file)
    except ConfigError as exc:
        assert str(exc).startswith(f"{config_file}: ") and "\n" not in str(exc)
        return
    _assert_sane(config)
