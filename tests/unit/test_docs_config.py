"""The manual's config reference (docs/config.md) shows the code's defaults: every value in its ```yaml block equals
JobConfig()'s, and the block parses."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from supervisor.config import JobConfig, parse_config

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config.md"
JOBS_OWN = {"script", "args", "nproc_per_node", "env"}  # examples of your job's values, not defaults
# Keys the block leaves to the page that explains them (its comment says where).
ELSEWHERE = {
    "command",
    "worker.ignore_data_skip",
    "worker.data_skip_steps",
    "worker.embedding_local_norm_threshold",
    "worker.embedding_param",
    "worker.feature_value_check",
}


def page_block() -> dict[str, Any]:
    """The page's first ```yaml block, parsed."""
    match = re.search(r"^```yaml\n(.*?)^```$", PAGE.read_text(encoding="utf-8"), re.DOTALL | re.MULTILINE)
    assert match, f"no ```yaml block in {PAGE}"
    return yaml.safe_load(match.group(1))


def leaves(shown: Mapping[str, Any], defaults: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(dotted key, value shown, default) for every value the block shows; a section (a dataclass) is walked
    into, any other value (a mapping such as phase_timeouts_s, a list) is compared whole."""
    for key, value in shown.items():
        name = f"{prefix}{key}"
        assert hasattr(defaults, key), f"{PAGE.name} shows '{name}', which the config does not have"
        default = getattr(defaults, key)
        if dataclasses.is_dataclass(default):
            assert isinstance(value, dict), f"{PAGE.name} shows '{name}' as {value!r}, not a section"
            yield from leaves(value, default, f"{name}.")
        else:
            yield name, value, dict(default) if isinstance(default, Mapping) else default


def names(config: Any, prefix: str = "") -> Iterator[str]:
    """Every dotted key of a config dataclass, sections walked into."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            yield from names(value, f"{prefix}{field.name}.")
        else:
            yield f"{prefix}{field.name}"


def test_every_value_in_the_config_page_block_is_the_default():
    """Each value shown, but the job's own examples, equals JobConfig()'s (a bool as a bool, not as 0 or 1)."""
    wrong = [
        f"{name}: {PAGE.name} {shown!r}, code {default!r}"
        for name, shown, default in leaves(page_block(), JobConfig())
        if name not in JOBS_OWN and (shown != default or isinstance(shown, bool) != isinstance(default, bool))
    ]
    assert not wrong, f"{PAGE}'s block differs from the defaults:\n" + "\n".join(wrong)


def test_the_config_page_block_shows_every_key():
    """Each config key is in the block, or left to the page named in the block's comment."""
    shown = {name for name, _, _ in leaves(page_block(), JobConfig())}
    elsewhere = [name for name in names(JobConfig()) if any(name == e or name.startswith(f"{e}.") for e in ELSEWHERE)]
    missing = sorted(set(names(JobConfig())) - shown - set(elsewhere))
    assert not missing, f"{PAGE}'s block lacks: {', '.join(missing)}"


def test_the_config_page_block_is_a_valid_config():
    """The block parses through parse_config: no unknown keys, no wrong types, no out-of-range values."""
    config = parse_config(page_block(), source="docs/config.md")
    assert config.script == "examples/demo_train.py"
