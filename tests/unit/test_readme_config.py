"""README's "Job config" block shows the code's defaults: every value in it equals JobConfig()'s, and it parses."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from supervisor.config import JobConfig, parse_config

README = Path(__file__).resolve().parents[2] / "README.md"
JOBS_OWN = {"script", "args", "nproc_per_node", "env"}  # examples of your job's values, not defaults
# Keys the block leaves to the README section that explains them (its comment says where).
ELSEWHERE = {"command", "worker.ignore_data_skip", "worker.data_skip_steps", "worker.embedding_local_norm_threshold",
             "worker.embedding_param", "worker.feature_value_check"}


def readme_block() -> dict[str, Any]:
    """The ```yaml block under "## Job config", parsed."""
    section = README.read_text(encoding="utf-8").split("\n## Job config\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"^```yaml\n(.*?)^```$", section, re.DOTALL | re.MULTILINE)
    assert match, 'no ```yaml block under "## Job config"'
    return yaml.safe_load(match.group(1))


def leaves(shown: Mapping[str, Any], defaults: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(dotted key, README value, default) for every value the block shows; a section (a dataclass) is walked
    into, any other value (a mapping such as phase_timeouts_s, a list) is compared whole."""
    for key, value in shown.items():
        name = f"{prefix}{key}"
        assert hasattr(defaults, key), f"the README shows '{name}', which the config does not have"
        default = getattr(defaults, key)
        if dataclasses.is_dataclass(default):
            assert isinstance(value, dict), f"the README shows '{name}' as {value!r}, not a section"
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


def test_every_value_in_the_readme_block_is_the_default():
    """Each value shown, but the job's own examples, equals JobConfig()'s (a bool as a bool, not as 0 or 1)."""
    wrong = [f"{name}: README {shown!r}, code {default!r}"
             for name, shown, default in leaves(readme_block(), JobConfig())
             if name not in JOBS_OWN and (shown != default or isinstance(shown, bool) != isinstance(default, bool))]
    assert not wrong, "README's Job config block differs from the defaults:\n" + "\n".join(wrong)


def test_the_readme_block_shows_every_key():
    """Each config key is in the block, or left to the README section named in the block's comment."""
    shown = {name for name, _, _ in leaves(readme_block(), JobConfig())}
    elsewhere = [name for name in names(JobConfig()) if any(name == e or name.startswith(f"{e}.") for e in ELSEWHERE)]
    missing = sorted(set(names(JobConfig())) - shown - set(elsewhere))
    assert not missing, f"README's Job config block lacks: {', '.join(missing)}"


def test_the_readme_block_is_a_valid_config():
    """The block parses through parse_config: no unknown keys, no wrong types, no out-of-range values."""
    config = parse_config(readme_block(), source="README.md")
    assert config.script == "examples/demo_train.py"
