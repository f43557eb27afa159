"""The manual's exit-code tables (docs/exit-codes.md) list exactly the codes of worker/contract.py's EXIT_* constants:
the supervisor's table those `trainwarden run` exits with, plus 0 (done) and 2 (usage); the rank's table those a
rank exits with that the supervisor tells apart, plus 0, and a row for anything else."""

from __future__ import annotations

import re
from pathlib import Path

from worker import contract

PAGE = Path(__file__).resolve().parents[2] / "docs" / "exit-codes.md"
# Every module-level int named EXIT_* in worker/contract.py. A new one is expected in both tables unless named below.
CODES = {
    name: value
    for name, value in vars(contract).items()
    if name.startswith("EXIT_") and isinstance(value, int) and not isinstance(value, bool)
}
SUPERVISOR_ONLY = {"EXIT_CRASH_LOOP", "EXIT_SAVE_LOST", "EXIT_REQUEUE"}  # "Supervisor only" in contract.py
# A rank's refusal, a rank's bad device; `trainwarden run` turns them into a relaunch, 78 or 75.
RANK_ONLY = {"EXIT_CHECKPOINT_REFUSED", "EXIT_BAD_DEVICE"}
CRASH = {"EXIT_FAILED"}  # from a rank, 1 is a crash like any other code: the "anything else" row


def table(header: str) -> list[tuple[int, str]]:
    """(line number, first cell) of each row of the table whose header row starts with `header`."""
    lines = PAGE.read_text(encoding="utf-8").splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(header)), None)
    assert start is not None, f"{PAGE}: no table with the header {header!r}"
    rows = []
    for number, line in enumerate(lines[start + 2 :], start + 3):
        if not line.startswith("|"):
            break
        rows.append((number, line.split("|")[1].strip()))
    return rows


def check(rows: list[tuple[int, str]], expected: set[int], other_row: bool) -> None:
    listed = {}
    for number, cell in rows:
        if other_row and cell.startswith("anything else"):
            continue
        assert re.fullmatch(r"\d+", cell), f"{PAGE}:{number}: {cell!r} is not an exit code"
        assert int(cell) in expected, f"{PAGE}:{number}: code {cell} is none of {sorted(expected)}"
        assert int(cell) not in listed, f"{PAGE}:{number}: code {cell} is listed twice"
        listed[int(cell)] = number
    missing = sorted(expected - set(listed))
    assert not missing, f"{PAGE}: the table has no row for {missing}"
    if other_row:
        assert any(cell.startswith("anything else") for _, cell in rows), f'{PAGE}: no "anything else" row'


def test_the_contract_has_the_constants_named_here() -> None:
    named = SUPERVISOR_ONLY | RANK_ONLY | CRASH
    assert named <= set(CODES), f"worker/contract.py has no {sorted(named - set(CODES))}"


def test_the_supervisor_table_lists_its_exit_codes_with_0_and_2() -> None:
    expected = {0, 2} | {code for name, code in CODES.items() if name not in RANK_ONLY}
    check(table("| code | meaning | retry? |"), expected, other_row=False)


def test_the_rank_table_lists_the_codes_the_supervisor_tells_apart() -> None:
    expected = {0} | {code for name, code in CODES.items() if name not in SUPERVISOR_ONLY | CRASH}
    check(table("| code | meaning | the supervisor |"), expected, other_row=True)
