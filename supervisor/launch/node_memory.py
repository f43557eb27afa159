"""The memory tier across nodes (Slurm): what each node's agent keeps, copies and serves, and the supervisor's choice.

Each node's agent creates the run's memory directory in its own node's shared memory (worker.memory) and gives it to
its ranks, which snapshot there as on one machine. The agent then does on its node what the supervisor's persister
does on one machine, and two things more:

- **persist**: pinned snapshots of its ranks copied to the run dir's checkpoints (supervisor.rundir.persist), so
  a disk checkpoint is complete once every node's agent copied its part;
- **partner copy**: the newest snapshot complete on all its ranks streamed to one partner node's agent (a ring over
  the attempt's nodes, so no single node loss takes both copies), rate-limited so that training traffic comes first;
  the partner keeps it in `MEMORY/peer/r<first rank>/{0,1}` (two slots, records last, as a rank's snapshot);
- **serve**: a replacement node's agent fetches the snapshot its ranks resume from out of whichever node holds it.

Each agent reports what it holds (`inventory`); the supervisor chooses the newest step held for every rank by a
node still in the run (`choose_memory`), newer than the newest healthy disk checkpoint, and tells each agent where
its ranks' files are. Before its ranks start, the agent gathers them into `MEMORY/resume/` (hard links of local
files, or fetched), every file checked against its record's size and CRC-32; any doubt and the launch fails with
the reason, and the supervisor passes that step over (`snapshot_passed_over`) for disk.

Streams carry a header line (JSON, capped) and then raw file bytes; both ends check the run's agent token, sizes
against the receiver's free memory, and checksums while writing. Nothing is unpickled, nothing is written outside
the memory directory or through a link. Torch-free.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import shutil
import socket
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

from supervisor.config import MAX_NPROC
from supervisor.rundir.persist import Persister, bytes_held, complete_for
from supervisor.rundir.throttle import Throttle
from worker.contract import RunLayout
from worker.files import atomic_write, atomic_write_json, file_crc32, open_regular, parse_json, read_json
from worker.memory import check_memory_dir, memory_dir_for
from worker.memory_tier import memory_room
from worker.store import MEMORY_LABEL, CheckpointStore, read_record

__all__ = [
    "MemoryChoice",
    "NodeMemory",
    "choose_memory",
    "parse_inventory",
    "resume_store",
    "unheld_ranks",
]

PEER_DIR = "peer"  # MEMORY/peer/r<first rank>/{0,1}/: a partner node's snapshot kept here
PUSHED_DIR = "pushed"  # MEMORY/pushed/{0,1}/: this node's own snapshots of the last two steps its partner holds
RESUME_DIR = "resume"  # MEMORY/resume/: the files this node's ranks resume from, gathered before they start
ORIGIN = "from.json"  # in a peer slot: which node sent it (written before its records)
MAX_HEADER_BYTES = 1 << 20
MAX_FILES = 4 * 1024  # per stream: a node's ranks, one file each
PUSH_POLL_S = 0.1  # how often the agent looks for a newer snapshot to copy to its partner
RETRY_S = 5.0  # after a failed copy to the partner
TIMEOUT_S = 10.0  # a stream that stalls this long is dropped
MAX_STREAMS = 16  # streams served at once; more wait in the listen backlog (a stranger cannot start a thousand threads)
_CHUNK = 1 << 20

Held = dict[int, dict[int, str | None]]  # rank -> step -> None (the node's own snapshot) or the node it came from


class StreamError(Exception):
    """A stream between agents broke or carried something that is not what its header said."""


# ---- the supervisor's side: what the nodes hold, and the choice ----------------------------------------------------


def parse_inventory(raw: Any) -> Held:
    """What an agent says its node holds (`NodeMemory.inventory`), checked field by field; garbage is left out."""
    held: Held = {}
    if not isinstance(raw, dict):
        return held
    sources: list[tuple[Any, str | None]] = [(raw.get("own"), None)]
    peers = raw.get("peer")
    if isinstance(peers, dict):
        sources += [(ranks, str(node)[:200]) for node, ranks in list(peers.items())[:MAX_FILES]]
    for ranks, origin in sources:
        if not isinstance(ranks, dict):
            continue
        for rank, steps in list(ranks.items())[:MAX_FILES]:
            if not (isinstance(rank, str) and rank.isdigit() and int(rank) < MAX_NPROC * 1024):
                continue
            if isinstance(steps, list):
                for step in steps[:8]:
                    if type(step) is int and step >= 0:
                        held.setdefault(int(rank), {}).setdefault(step, origin)
    return held


@dataclass(frozen=True)
class MemoryChoice:
    """A step held in memory for every rank: which node holds each rank's files, and how `resume_source` says it."""

    step: int
    holders: dict[int, str]  # rank -> the node holding its snapshot of `step`
    label: str  # "memory", or "memory (peer twnode1)" when some ranks come from a partner's copy


def choose_memory(
    held: Mapping[str, Held],
    world_size: int,
    *,
    newer_than: int | None,
    at_most: int | None = None,
    refused: Mapping[int, str] | None = None,
) -> MemoryChoice | None:
    """The newest step that nodes of `held` (node -> what it holds) hold for every rank, newer than `newer_than` (the
    newest usable disk checkpoint), at most `at_most`, not `refused`; a node's own copy is preferred to a peer's."""
    refused = refused or {}
    steps = {step for ranks in held.values() for by_step in ranks.values() for step in by_step}
    for step in sorted(steps, reverse=True):
        if (newer_than is not None and step <= newer_than) or (at_most is not None and step > at_most):
            continue
        if step in refused:
            continue
        holders: dict[int, tuple[str, str | None]] = {}
        for node, ranks in sorted(held.items()):  # each node's own ranks only: a thousand nodes stay cheap
            for rank, by_step in ranks.items():
                if rank < world_size and step in by_step and (rank not in holders or holders[rank][1] is not None):
                    holders[rank] = (node, by_step[step])
        if len(holders) == world_size:
            peers = sorted({node for node, origin in holders.values() if origin is not None})
            label = MEMORY_LABEL if not peers else f"{MEMORY_LABEL} (peer {', '.join(peers)})"
            return MemoryChoice(step, {rank: node for rank, (node, _) in holders.items()}, label)
    return None


def unheld_ranks(held: Mapping[str, Held], world_size: int, *, newer_than: int | None) -> tuple[int, list[int]] | None:
    """The newest step newer than disk that some node holds, and the ranks no node holds it for (a node and its
    partner both lost); None when every rank's is held, or nothing newer than disk is."""
    steps = {step for ranks in held.values() for by_step in ranks.values() for step in by_step}
    newest = max((step for step in steps if newer_than is None or step > newer_than), default=None)
    if newest is None:
        return None
    covered = {rank for ranks in held.values() for rank, by_step in ranks.items() if newest in by_step}
    missing = sorted(set(range(world_size)) - covered)
    return (newest, missing) if missing else None


def resume_store(memory: Path) -> CheckpointStore:
    """Where a node's ranks resume from in memory: the same path on every node (the run's memory directory's name
    depends on the run dir and the user only)."""
    return CheckpointStore(memory / RESUME_DIR, label=MEMORY_LABEL, base=memory)


# ---- the agent's side ----------------------------------------------------------------------------------------------


class NodeMemory:
    """One node's memory tier, run by its agent: serves the node's snapshots to other agents, persists its ranks'
    pins, copies its newest snapshot to the partner node, gathers what its ranks resume from."""

    def __init__(self, layout: RunLayout, node: str, token: str, prefix: str, say: Callable[..., None]) -> None:
        assert layout.memory is not None
        self.layout, self.memory = layout, layout.memory
        self.node, self._token, self.prefix = node, token, prefix
        self._say = say  # (event, level, **fields): the agent's journal
        self._server: socket.socket | None = None
        self.port: int | None = None  # where other agents reach this one (`serve`)
        self._stop = threading.Event()
        self._persister: Persister | None = None
        self._copier_stop = threading.Event()  # the current attempt's copies to the partner end when set
        self._streams = threading.BoundedSemaphore(MAX_STREAMS)
        self._pushed: int | None = None  # the newest step copied to the partner
        self._push_failed: str | None = None  # what the last copy to the partner said, said once

    # -- serving --

    def serve(self) -> int:
        """Listen for other agents (a partner's copy, a replacement's fetch); the port."""
        server = socket.create_server(("0.0.0.0", 0), backlog=16)
        self._server = server
        self.port = int(server.getsockname()[1])
        threading.Thread(target=self._accept, name="memory-server", daemon=True).start()
        return self.port

    def _accept(self) -> None:
        assert self._server is not None
        while not self._stop.is_set():
            self._streams.acquire()
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(sock,), name="memory-stream", daemon=True).start()

    def _handle(self, sock: socket.socket) -> None:
        try:
            with sock, contextlib.suppress(OSError, ValueError, StreamError):  # a stranger's garbage ends its stream
                self._serve(sock)
        finally:
            self._streams.release()

    def _serve(self, sock: socket.socket) -> None:
        """One stream: a partner's copy received, or a fetch answered; StreamError when it is not ours."""
        sock.settimeout(TIMEOUT_S)
        reader = sock.makefile("rb")
        header = _read_header(reader)
        if not hmac.compare_digest(str(header.get("token", "")), self._token):
            raise StreamError("wrong token")
        if header.get("type") == "push":
            try:
                self._receive_push(header, reader)
            except StreamError as exc:
                _send_line(sock, {"ok": False, "error": str(exc)[:300]})
                raise
            _send_line(sock, {"ok": True})
        elif header.get("type") == "fetch":
            self._send_fetched(sock, header)

    def _receive_push(self, header: dict[str, Any], reader: IO[bytes]) -> None:
        origin, step, files = str(header.get("from", ""))[:200], header.get("step"), _files_of(header)
        if type(step) is not int or step < 0 or not files or not origin:
            raise StreamError("a push without its node, step or files")
        ranks = sorted(entry["rank"] for entry in files)
        group = self.memory / PEER_DIR / f"r{ranks[0]}"
        slot = _older_slot(group, ranks, self.prefix)
        store = CheckpointStore(slot, label=MEMORY_LABEL, base=self.memory)
        shutil.rmtree(slot, ignore_errors=True)  # the older copy goes; the newer one stays whole meanwhile
        _check_room(self.memory, files)
        atomic_write_json(slot / ORIGIN, {"node": origin}, root=self.memory)
        _receive_files(reader, store, step, files, self.prefix)

    def _send_fetched(self, sock: socket.socket, header: dict[str, Any]) -> None:
        step, ranks = header.get("step"), header.get("ranks")
        if type(step) is not int or not isinstance(ranks, list) or not all(type(r) is int for r in ranks):
            raise StreamError("a fetch without its step or ranks")
        try:
            files = [self._local_file(rank, step) for rank in ranks[:MAX_FILES]]
        except StreamError as exc:
            _send_line(sock, {"ok": False, "error": str(exc)[:300]})
            return
        _send_line(sock, {"ok": True, "files": [entry for entry, _ in files]})
        for entry, path in files:
            _send_file(sock, path, entry, rate=None)

    def _local_file(self, rank: int, step: int) -> tuple[dict[str, Any], Path]:
        """A rank's snapshot of `step` held here (own slots, pins, partner copies): its header entry and path."""
        for store, _origin in self._stores():
            if step in store.steps(rank, self.prefix):
                try:
                    record = read_record(store, rank, step, self.prefix)
                except (OSError, ValueError):
                    continue
                entry = {"rank": rank, "size": record["size"], "crc32": record["crc32"], "record": record}
                return entry, store.file(rank, step, self.prefix)
        raise StreamError(f"rank {rank}'s snapshot of step {step} is not held on {self.node}")

    # -- what this node holds --

    def _stores(self) -> Iterator[tuple[CheckpointStore, str | None]]:
        return node_stores(self.layout)

    def inventory(self) -> dict[str, Any]:
        """What this node holds, for the supervisor (`inventory`)."""
        return inventory(self.layout, self.prefix)

    # -- an attempt's ranks: persist and copy to the partner --

    def run_for(
        self,
        ranks: Sequence[int],
        world_size: int,
        partner: str | None,
        rate_bytes_s: float,
        log: Any,
        *,
        persist_mb_s: float = 0.0,
    ) -> None:
        """While this attempt's `ranks` run: their pins persisted (at most `persist_mb_s`), their snapshots copied to
        `partner` (at most `rate_bytes_s`)."""
        self.stop_persisting()  # the attempt before, recovering in place: its ranks go on in this one
        self._copier_stop.set()
        self._copier_stop = copier_stop = threading.Event()
        self._persister = Persister(self.layout, world_size, self.prefix, log, ranks=ranks, persist_mb_s=persist_mb_s)
        self._persister.start()
        if partner is not None:
            threading.Thread(
                target=self._push_loop,
                args=(tuple(ranks), partner, rate_bytes_s, copier_stop),
                name="memory-push",
                daemon=True,
            ).start()

    def _push_loop(self, ranks: tuple[int, ...], partner: str, rate: float, ended: threading.Event) -> None:
        """Every snapshot in turn while the partner keeps up (the oldest not yet copied that is still held), so that
        every node's partner holds the same steps; each step copied is kept here too, for the common choice. Until
        the agent ends, or the next attempt's copier takes over (`ended`)."""
        while not self._stop.wait(PUSH_POLL_S) and not ended.is_set():
            step = self._next_to_push(ranks)
            if step is None:
                continue
            try:
                self._push(ranks, step, partner, rate)
                self._keep_pushed(ranks, step)
                self._pushed, self._push_failed = step, None
            except (OSError, StreamError) as exc:
                why = f"{exc.strerror or exc}" if isinstance(exc, OSError) else str(exc)
                if why != self._push_failed:
                    self._say("peer_copy_failed", "warning", step=step, partner=partner, reason=why[:300])
                self._push_failed = why
                self._stop.wait(RETRY_S)

    def _next_to_push(self, ranks: tuple[int, ...]) -> int | None:
        held = {step for store in self.layout.memory_stores() for step in _complete_steps(store, ranks, self.prefix)}
        if self._pushed is None:
            return max(held, default=None)
        return min((step for step in held if step > self._pushed), default=None)

    def _keep_pushed(self, ranks: tuple[int, ...], step: int) -> None:
        """This node's own files of `step` linked into the older `pushed` slot: the step its partner now holds stays
        here too, whatever the ranks' slots hold next (every node keeps the last two steps it copied)."""
        slot = _older_slot(self.memory / PUSHED_DIR, ranks, self.prefix)
        kept = CheckpointStore(slot, label=MEMORY_LABEL, base=self.memory)
        shutil.rmtree(slot, ignore_errors=True)
        for rank in ranks:
            _, path = self._local_file(rank, step)
            kept.rank_dir(rank).mkdir(parents=True, exist_ok=True)
            os.link(path, kept.file(rank, step, self.prefix), follow_symlinks=False)
            source = path.parent / kept.record(rank, step, self.prefix).name
            os.link(source, kept.record(rank, step, self.prefix), follow_symlinks=False)  # after its file

    def _push(self, ranks: tuple[int, ...], step: int, partner: str, rate: float) -> None:
        files = [self._local_file(rank, step) for rank in ranks]
        host, _, port = partner.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
            _send_line(
                sock,
                {"type": "push", "token": self._token, "from": self.node, "step": step, "files": [e for e, _ in files]},
            )
            for entry, path in files:
                _send_file(sock, path, entry, rate=rate)
            answer = _read_header(sock.makefile("rb"))
        if answer.get("ok") is not True:
            raise StreamError(f"the partner refused it: {str(answer.get('error'))[:300]}")

    # -- resuming --

    def prepare_resume(self, step: int, sources: Mapping[int, str | None], world_size: int) -> str | None:
        """Gather every rank's snapshot of `step` into MEMORY/resume/ (`sources`: rank -> None when held here, else
        the holder's host:port), each file checked against its record; None, or why not."""
        store = resume_store(self.memory)
        shutil.rmtree(store.root, ignore_errors=True)
        for rank, holder in sorted(sources.items()):
            try:
                if holder is None:
                    self._link_local(store, rank, step)
                else:
                    self._fetch(store, [rank], step, holder)
                _check_world_size(read_record(store, rank, step, self.prefix), world_size)
            except (OSError, ValueError, StreamError) as exc:
                shutil.rmtree(store.root, ignore_errors=True)
                where = "here" if holder is None else f"from {holder}"
                return f"rank {rank}'s snapshot of step {step} ({where}): {exc}"
        return None

    def _link_local(self, store: CheckpointStore, rank: int, step: int) -> None:
        entry, path = self._local_file(rank, step)
        size, crc = file_crc32(path, limit=entry["size"])
        if (size, crc) != (entry["size"], entry["crc32"]):
            raise StreamError("it does not match its record (size or checksum): damaged in memory")
        store.rank_dir(rank).mkdir(parents=True, exist_ok=True)
        os.link(path, store.file(rank, step, self.prefix), follow_symlinks=False)
        atomic_write_json(store.record(rank, step, self.prefix), entry["record"], root=self.memory)

    def _fetch(self, store: CheckpointStore, ranks: list[int], step: int, holder: str) -> None:
        host, _, port = holder.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
            _send_line(sock, {"type": "fetch", "token": self._token, "step": step, "ranks": ranks})
            reader = sock.makefile("rb")
            answer = _read_header(reader)
            if answer.get("ok") is not True:
                raise StreamError(str(answer.get("error"))[:300])
            files = _files_of(answer)
            if sorted(e["rank"] for e in files) != sorted(ranks):
                raise StreamError("the holder sent other ranks than asked")
            _check_room(self.memory, files)
            _receive_files(reader, store, step, files, self.prefix)

    def stop_persisting(self) -> None:
        """The attempt's ranks are gone: the copy under way finishes, no new one starts (the pins wait in memory)."""
        if self._persister is not None:
            self._persister.stop()
            self._persister = None

    def close(self) -> None:
        self._stop.set()
        self.stop_persisting()
        if self._server is not None:
            self._server.close()


def _check_world_size(record: dict[str, Any], world_size: int) -> None:
    written = record.get("world_size")
    if type(written) is int and written != world_size:
        raise StreamError(f"written by {written} ranks; this attempt has {world_size}")


def node_stores(layout: RunLayout) -> Iterator[tuple[CheckpointStore, str | None]]:
    """A node's memory stores: own slots, pins and the steps last copied to the partner first, then partner copies
    (with the node each came from)."""
    assert layout.memory is not None
    yield from ((store, None) for store in layout.memory_stores())
    for slot in _plain_dirs(layout.memory / PUSHED_DIR):
        yield CheckpointStore(slot, label=MEMORY_LABEL, base=layout.memory), None
    for group in _plain_dirs(layout.memory / PEER_DIR):
        for slot in _plain_dirs(group):
            origin = read_origin(slot)
            if origin is not None:
                yield CheckpointStore(slot, label=MEMORY_LABEL, base=layout.memory), origin


def inventory(layout: RunLayout, prefix: str) -> dict[str, Any]:
    """What a node's memory holds, as its agent reports it: own and partner snapshots per rank (complete, and healthy
    as their records say; the newest four steps each), and the bytes."""
    assert layout.memory is not None
    own: dict[str, set[int]] = {}
    peer: dict[str, dict[str, set[int]]] = {}
    for store, origin in node_stores(layout):
        into = own if origin is None else peer.setdefault(origin, {})
        for rank in _ranks_in(store.root):
            steps = {step for step in store.steps(rank, prefix) if _healthy(store, rank, step, prefix)}
            into.setdefault(str(rank), set()).update(steps)
    return {
        "own": {rank: sorted(steps)[-4:] for rank, steps in own.items() if steps},
        "peer": {
            node: {r: sorted(s)[-4:] for r, s in ranks.items() if s}
            for node, ranks in peer.items()
            if any(ranks.values())
        },
        "bytes": bytes_held(layout.memory),
    }


def held_here(layout: RunLayout, prefix: str) -> dict[str, Any] | None:
    """What this machine's memory directory of the run holds (a successor starting on a node of the run: its own
    snapshots and a partner's copy survive the supervisor it replaces); None without a directory we may trust."""
    try:
        memory = check_memory_dir(memory_dir_for(layout.root))
    except OSError:
        return None
    return inventory(replace(layout, memory=memory), prefix)


def _healthy(store: CheckpointStore, rank: int, step: int, prefix: str) -> bool:
    try:
        return read_record(store, rank, step, prefix).get("is_health", 0) == 0
    except (OSError, ValueError):
        return False


def read_origin(slot: Path) -> str | None:
    """The node a partner copy came from (its `from.json`), or None when unreadable."""
    try:
        node = read_json(slot / ORIGIN)
    except (OSError, ValueError):
        return None
    return str(node["node"])[:200] if isinstance(node, dict) and isinstance(node.get("node"), str) else None


# ---- streams --------------------------------------------------------------------------------------------------------


def _send_line(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")


def _read_header(reader: IO[bytes]) -> dict[str, Any]:
    line = reader.readline(MAX_HEADER_BYTES + 1)
    if not line.endswith(b"\n"):
        raise StreamError("no header line (or one too long)")
    try:
        header = parse_json(line)
    except ValueError as exc:
        raise StreamError(f"a header that is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise StreamError("a header that is not an object")
    return header


def _files_of(header: dict[str, Any]) -> list[dict[str, Any]]:
    """The header's file entries, each checked: a rank, a size, a checksum and a record that says the same."""
    files = header.get("files")
    if not isinstance(files, list) or len(files) > MAX_FILES:
        raise StreamError("no list of files")
    for entry in files:
        ok = (
            isinstance(entry, dict)
            and type(entry.get("rank")) is int
            and 0 <= entry["rank"] < MAX_NPROC * 1024
            and type(entry.get("size")) is int
            and entry["size"] >= 0
            and isinstance(entry.get("crc32"), str)
            and isinstance(entry.get("record"), dict)
            and entry["record"].get("size") == entry["size"]
            and entry["record"].get("crc32") == entry["crc32"]
        )
        if not ok:
            raise StreamError(f"a file entry that is not one: {str(entry)[:200]}")
    if len({entry["rank"] for entry in files}) != len(files):
        raise StreamError("a rank twice")
    return files


def _check_room(memory: Path, files: list[dict[str, Any]]) -> None:
    needed = sum(entry["size"] for entry in files)
    room, limit = memory_room(memory)
    if needed > room:
        raise StreamError(f"{needed} bytes do not fit in this node's memory ({room} bytes free: {limit})")


def _send_file(sock: socket.socket, path: Path, entry: dict[str, Any], *, rate: float | None) -> None:
    """Stream `path`'s `entry["size"]` bytes, checking them against the entry's CRC-32 on the way (a snapshot
    damaged in memory is not copied on); at most `rate` bytes a second (training traffic first)."""
    fd = open_regular(path)
    throttle, sent, crc = Throttle(rate or 0), 0, 0
    try:
        while sent < entry["size"]:
            chunk = os.read(fd, min(_CHUNK, entry["size"] - sent))
            if not chunk:
                raise StreamError(f"rank {entry['rank']}'s file is shorter than its record")
            crc = zlib.crc32(chunk, crc)
            sock.sendall(chunk)
            sent += len(chunk)
            throttle.sent(len(chunk))
    finally:
        os.close(fd)
    if f"{crc:08x}" != entry["crc32"]:
        raise StreamError(f"rank {entry['rank']}'s file does not match its record: damaged in memory")


def _receive_files(
    reader: IO[bytes], store: CheckpointStore, step: int, files: list[dict[str, Any]], prefix: str
) -> None:
    """Each file in turn, checked while written; the records after every file, so a broken stream leaves no
    snapshot that looks complete."""
    root = store.write_root
    for entry in files:
        _receive_file(reader, store.file(entry["rank"], step, prefix), entry, root)
    for entry in files:
        atomic_write_json(store.record(entry["rank"], step, prefix), entry["record"], root=root)


def _receive_file(reader: IO[bytes], path: Path, entry: dict[str, Any], root: Path) -> None:
    def write(out: IO[bytes]) -> None:
        left, crc = entry["size"], 0
        while left:
            chunk = reader.read(min(_CHUNK, left))
            if not chunk:
                raise StreamError(f"the stream ended {left} bytes short of rank {entry['rank']}'s file")
            crc = zlib.crc32(chunk, crc)
            out.write(chunk)
            left -= len(chunk)
        if f"{crc:08x}" != entry["crc32"]:
            raise StreamError(f"rank {entry['rank']}'s file arrived with another checksum than its record's")

    atomic_write(path, write, root=root, durable=False)  # memory: nothing to sync to


# ---- the memory directory ----------------------------------------------------------------------------------------


def _plain_dirs(directory: Path) -> list[Path]:
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    return sorted(Path(e.path) for e in entries if e.is_dir(follow_symlinks=False))


def _ranks_in(root: Path) -> list[int]:
    names = (path.name for path in _plain_dirs(root))
    return [int(name[5:]) for name in names if name.startswith("rank_") and name[5:].isdigit()]


def _complete_steps(store: CheckpointStore, ranks: Sequence[int], prefix: str) -> set[int]:
    steps = set.intersection(*(store.steps(rank, prefix) for rank in ranks)) if ranks else set()
    return {step for step in steps if complete_for(store, step, ranks, prefix)}


def _older_slot(group: Path, ranks: Sequence[int], prefix: str) -> Path:
    """The partner-copy slot not holding the newest complete copy of `ranks` (slot 0 when neither does)."""
    newest: dict[int, int] = {}
    for slot in (0, 1):
        steps = _complete_steps(CheckpointStore(group / str(slot)), ranks, prefix)
        if steps:
            newest[slot] = max(steps)
    if not newest:
        return group / "0"
    return group / str(1 - max(newest, key=lambda slot: newest[slot]))
