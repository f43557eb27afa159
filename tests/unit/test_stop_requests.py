"""Stop file content (seed 004's rules plus a kill switch), parsed with plain values."""

from __future__ import annotations

import pytest

from supervisor.core.stop_requests import MAX_STOP_FILE_BYTES, StopFileUnparsable, StopRequest, parse_stop_file

SOURCE = "stop file /run/stop"


@pytest.mark.parametrize(
    ("content", "step", "exit"),
    [
        (b"", None, True),  # touch stop
        (b"  \n", None, True),
        (b"stop\n", None, True),  # BLOOM's kill switch: any words
        (b"500\n", 500, True),  # seed 004: save at 500 and exit
        (b"-500", 500, False),  # seed 004: save at 500 and continue
        (b"\t 42 \r\n", 42, True),
    ],
)
def test_accepted_content(content: bytes, step: int | None, exit: bool) -> None:
    assert parse_stop_file(content, SOURCE) == StopRequest(step, exit, SOURCE)


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"12abc", "got '12abc'; expected nothing (save now and exit), a step N"),
        (b"1.5", "got '1.5'"),
        (b"0", "got '0'"),
        (b"--3", "got '--3'"),
        (b"500 600", "got '500 600'"),
        (b"\xff\xfe5", "not text (not UTF-8)"),
        (b"5\x00", "not text (control characters)"),
        (b"\x01\x02\x1b[2J", "not text (control characters)"),  # no digit, yet not a kill switch either
        (b"stop\x7f", "not text (control characters)"),
        (b"1" * (MAX_STOP_FILE_BYTES + 1), f"{MAX_STOP_FILE_BYTES + 1} bytes"),
    ],
)
def test_garbage_is_refused_with_what_it_holds(content: bytes, why: str) -> None:
    with pytest.raises(StopFileUnparsable) as refused:
        parse_stop_file(content, SOURCE)
    assert why in str(refused.value)
