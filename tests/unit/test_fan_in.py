"""What keeps the supervisor cheap at scale, with real files, inotify and sockets: heartbeat files read only when
they changed, bursts of writes coalesced into one hint, many agents' streams read by one thread."""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from pathlib import Path

import pytest

from supervisor.launch.agent import beat_record
from supervisor.launch.wire import Hub, Peer
from supervisor.rundir.watch import (
    HeartbeatFiles,
    HeartbeatsChanged,
    HeartbeatUnreadable,
    HeartbeatWatcher,
    progress_fields,
)
from worker.contract import RunLayout
from worker.files import atomic_write_json, ensure_dir

pytestmark = pytest.mark.timeout(30)


def _beat(layout: RunLayout, rank: int, seq: int) -> None:
    record = {"attempt": 0, "rank": rank, "seq": seq, "step": seq, "phase": "train"}
    atomic_write_json(layout.heartbeat(rank), record, root=layout.root, durable=False)


@pytest.fixture
def layout(tmp_path: Path) -> RunLayout:
    layout = RunLayout(tmp_path / "run")
    for rank in range(4):
        ensure_dir(layout.root, layout.rank_dir(rank))
    return layout


def test_a_heartbeat_file_is_read_once_per_change(layout: RunLayout) -> None:
    """A new record is read; the same file again is not (None, no parse); a rewrite is; a removed one is nothing."""
    files = HeartbeatFiles(layout)
    assert files.read(0) is None
    _beat(layout, 0, 1)
    assert files.read(0).seq == 1
    assert files.read(0) is None
    _beat(layout, 0, 2)
    assert files.read(0).seq == 2
    layout.heartbeat(0).unlink()
    assert files.read(0) is None


def test_garbage_is_reported_at_every_look_while_it_stays_but_read_once(layout: RunLayout) -> None:
    """A torn record raises at every look (the caller says so once per streak), then a good one is read."""
    files = HeartbeatFiles(layout)
    layout.heartbeat(1).write_text('{"attempt": 0, "rank": 1, "se')
    for _ in range(2):
        with pytest.raises(HeartbeatUnreadable):
            files.read(1)
    _beat(layout, 1, 5)
    assert files.read(1).seq == 5


def test_a_burst_of_beats_is_one_hint_and_take_says_which_ranks(layout: RunLayout) -> None:
    """Fifty writes by three ranks before the main loop looks are one HeartbeatsChanged in its inbox; `take` names
    the three ranks once, and a later write is a new hint."""
    inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
    watcher = HeartbeatWatcher(layout, 4, inbox.put)
    watcher.start()
    try:
        for seq in range(1, 51):
            _beat(layout, seq % 3, seq)
        assert isinstance(inbox.get(timeout=5), HeartbeatsChanged)
        time.sleep(0.3)  # every write has been seen
        assert inbox.empty()
        assert watcher.take() == {0, 1, 2}
        _beat(layout, 3, 1)
        assert isinstance(inbox.get(timeout=5), HeartbeatsChanged)
        time.sleep(0.1)
        assert watcher.take() == {3}
    finally:
        watcher.stop()


def _pair() -> tuple[Peer, socket.socket]:
    """Our end of a TCP connection on this machine (as the supervisor accepts an agent's), and the agent's end."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        theirs = socket.create_connection(server.getsockname())
        ours, _ = server.accept()
    return Peer(ours), theirs


def test_one_hub_thread_reads_many_streams_whole_messages_in_order() -> None:
    """Messages split across writes, and several in one write, arrive whole and in order for each of 50 peers; a
    clean end of stream is None, garbage is the reason the stream was dropped."""
    hub = Hub()
    got: dict[int, list[dict]] = {i: [] for i in range(50)}
    ended: dict[int, str | None] = {}
    done = threading.Event()

    def end(i: int, why: str | None) -> None:
        ended[i] = why
        if len(ended) == 50:
            done.set()

    pairs = [_pair() for _ in range(50)]
    for i, (peer, _) in enumerate(pairs):
        hub.add(peer, lambda m, i=i: got[i].append(m), lambda why, i=i: end(i, why))
    try:
        for i, (_, theirs) in enumerate(pairs):
            lines = b"".join(json.dumps({"type": "beat", "n": n}).encode() + b"\n" for n in range(3))
            theirs.sendall(lines[:7])
            theirs.sendall(lines[7:])
            if i == 7:
                theirs.sendall(b"not json\n")
            theirs.close()
        assert done.wait(10)
        assert all(got[i] == [{"type": "beat", "n": n} for n in range(3)] for i in range(50))
        assert ended[7] is not None and "not a message" in ended[7]
        assert all(ended[i] is None for i in range(50) if i != 7), ended
    finally:
        hub.close()


def test_a_handler_that_raises_drops_only_its_peer() -> None:
    """One peer's message that its handler cannot take ends that peer's stream with the reason; others go on."""
    hub = Hub()
    bad, bad_end = _pair()
    good, good_end = _pair()
    ended: queue.SimpleQueue[str | None] = queue.SimpleQueue()
    got: queue.SimpleQueue[dict] = queue.SimpleQueue()

    def explode(message: dict) -> None:
        raise KeyError("beats")

    hub.add(bad, explode, ended.put)
    hub.add(good, got.put, lambda why: None)
    try:
        bad_end.sendall(b'{"type": "beat"}\n')
        assert "KeyError" in ended.get(timeout=5)
        good_end.sendall(b'{"type": "beat"}\n')
        assert got.get(timeout=5) == {"type": "beat"}
    finally:
        hub.close()
        for sock in (bad_end, good_end):
            sock.close()


def test_the_hub_takes_a_new_peer_on_a_reused_descriptor_number() -> None:
    """A peer closed by its owner (a lost node) while the hub still watched it, then a new peer that the kernel
    gives the same descriptor number: the new one is read, the old one's end is said once."""
    hub = Hub()
    old, old_end = _pair()
    ended: queue.SimpleQueue[str | None] = queue.SimpleQueue()
    hub.add(old, lambda m: None, ended.put)
    time.sleep(0.1)
    number = old.fileno()
    old.close()  # the hub may never hear of it: a closed descriptor leaves epoll without an event
    old_end.close()
    new, new_end = _pair()
    assert new.fileno() == number  # the kernel hands out the lowest free number
    got: queue.SimpleQueue[dict] = queue.SimpleQueue()
    hub.add(new, got.put, lambda why: None)
    try:
        new_end.sendall(b'{"type": "hello"}\n')
        assert got.get(timeout=5) == {"type": "hello"}
        # Said at the new peer's joining, or by a read of the old descriptor that select() had reported just before
        # its close (EBADF): either way once.
        why = ended.get(timeout=5)
        assert why in ("connection closed", None, "connection broken: Bad file descriptor"), why
        assert ended.empty()
    finally:
        hub.close()
        new_end.close()


def test_a_ranks_word_on_slow_saves_reads_the_same_from_its_file_and_from_a_node_agents_forward(
    layout: RunLayout,
) -> None:
    """`slow_saves` in a heartbeat file becomes the beat's SlowSaves, and survives an agent's forward (as JSON) intact;
    one with a bad duration or a control character is dropped, the beat kept."""
    said = {"write_s": 3.2, "interval_s": 0.4, "setting": "worker.save_checkpoint_steps: 40 or more"}
    record = {"attempt": 0, "rank": 0, "seq": 1, "step": 10, "phase": "train", "slow_saves": said}
    atomic_write_json(layout.heartbeat(0), record, root=layout.root, durable=False)
    seen = HeartbeatFiles(layout).read(0)
    assert seen is not None and seen.slow_saves is not None and vars(seen.slow_saves) == said
    forwarded = json.loads(json.dumps(beat_record(seen)))
    assert progress_fields(forwarded)["slow_saves"] == seen.slow_saves
    for bad in ({**said, "write_s": -1}, {**said, "interval_s": "0.4"}, {**said, "setting": "\x1b[2J"}, [3.2, 0.4]):
        assert progress_fields({"slow_saves": bad})["slow_saves"] is None
