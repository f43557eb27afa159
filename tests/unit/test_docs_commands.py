"""Every shell block in README.md, CONTRIBUTING.md and docs/*.md says what it is: ```sh title="illustrative", or
```sh title="run by PATH[, PATH]" where each PATH exists and names the block's main command: every `trainwarden`
subcommand and config file the block uses (a test's conftest.py counts as part of it), or, for a block without
`trainwarden`, each command line verbatim (whitespace aside), as .ci/run has the README's test command."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHELL = {"sh", "bash", "shell", "console"}
FENCE = re.compile(r'^```(?P<lang>[\w-]*)(?:\s+title="(?P<title>[^"]*)")?\s*$')
SUBCOMMAND = re.compile(r"(?:^|[\s/])trainwarden\s+([a-z][\w-]*)")
CONFIG = re.compile(r"[\w./-]+\.(?:yaml|sbatch)\b")


def pages() -> list[Path]:
    return [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]


def shell_blocks(page: Path) -> Iterator[tuple[int, str, str | None, list[str]]]:
    """(line number of the fence, language, title, body lines) of each shell block."""
    lines = page.read_text(encoding="utf-8").splitlines()
    opened = None
    for number, line in enumerate(lines, 1):
        if opened is None and line.startswith("```"):
            match = FENCE.match(line)
            assert match, f"{page}:{number}: unreadable fence {line!r}"
            opened = (number, match["lang"], match["title"])
        elif opened is not None and line.strip() == "```":
            if opened[1] in SHELL:
                yield opened[0], opened[1], opened[2], lines[opened[0] : number - 1]
            opened = None
    assert opened is None, f"{page}:{opened[0]}: fence never closed"


def commands(lang: str, body: list[str]) -> list[str]:
    """The block's command lines, continuations joined and comments dropped (console: the `$ ` lines only)."""
    result: list[str] = []
    continued = False
    for line in body:
        if continued:
            result[-1] += " " + line.strip()
        elif lang == "console":
            if line.startswith("$ "):
                result.append(line[2:])
        elif line.strip() and not line.lstrip().startswith("#"):
            result.append(line)
        continued = bool(result) and result[-1].endswith("\\")
        if continued:
            result[-1] = result[-1][:-1]
    return [" ".join(re.sub(r"\s#.*$", "", command).split()) for command in result]


def test_every_shell_block_is_titled_illustrative_or_run_by_a_test_that_runs_it() -> None:
    problems = []
    for page in pages():
        for number, lang, title, body in shell_blocks(page):
            where = f"{page.relative_to(REPO)}:{number}"
            if title == "illustrative":
                continue
            if not title or not title.startswith("run by "):
                problems.append(f'{where}: a {lang} block needs title="illustrative" or title="run by PATH"')
                continue
            paths = [REPO / path for path in title.removeprefix("run by ").split(", ")]
            if absent := [str(path.relative_to(REPO)) for path in paths if not path.is_file()]:
                problems.append(f"{where}: {', '.join(absent)} does not exist")
                continue
            helpers = {
                folder / "conftest.py"
                for path in paths
                for folder in path.parents
                if REPO / "tests" in (folder, *folder.parents)
            }
            text = " ".join(path.read_text(encoding="utf-8") for path in [*paths, *helpers] if path.is_file())
            flat = " ".join(text.replace("\\\n", " ").split())
            lines = commands(lang, body)
            words = {w for line in lines for w in SUBCOMMAND.findall(line) + CONFIG.findall(line)}
            wanted = words or set(lines)
            if missing := sorted(w for w in wanted if w not in (text if words else flat)):
                problems.append(f"{where}: {title.removeprefix('run by ')} never mentions {missing}")
    assert not problems, "\n".join(problems)
