"""The `trainwarden` command: `run` a job under supervision, `status` of a run dir, `stop` it gracefully,
`nodes` of a multi-node run (and forgive one), `export` a checkpoint's model weights, `plot` a run as one picture."""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from supervisor.config import ConfigError, JobConfig, SlurmConfig, check_launchable, load_config
from supervisor.core import Phase, State
from supervisor.export import ExportError, export_weights
from supervisor.launch.gpu_health import preflight
from supervisor.launch.launcher import LocalLauncher
from supervisor.launch.nodes import USABLE, Ledger, render_rows, update_ledger
from supervisor.launch.slurm import SlurmLauncher, in_allocation
from supervisor.launch.slurmctl import PING_TIMEOUT_S, SlurmError, allocation, node_states, shortfall
from supervisor.launch.succession import end_job, take_lease, take_over, wait_after_handover
from supervisor.observe.console import ENV_LOG_FORMAT, LOG_FORMATS, Console, choose_format
from supervisor.observe.goodput import describe as describe_goodput
from supervisor.observe.status import StatusError, read_status, render, shown_state
from supervisor.rundir.journal import open_journal
from supervisor.rundir.lease import LOCAL_TTL_S, Lease
from supervisor.runner import LauncherFactory, RunDirBusy, Supervisor, lock_run_dir
from worker.contract import EXIT_CONFIG, EXIT_FAILED, RunLayout
from worker.files import atomic_write_bytes
from worker.memory import check_memory_dir, memory_dir_for
from worker.store import newest_complete

__all__ = ["main"]


ENV_SET = "TRAINWARDEN_SET"  # `--set` overrides from the environment (sbatch passes it on to the batch script)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    # What a successor supervisor is started with.
    args.argv = [arg for arg in argv if arg not in ("--successor", "--take-over")]
    try:
        code = args.func(args)
        sys.stdout.flush()  # a reader gone early (`status | head -1`) shows up here, not as a traceback at exit
    except BrokenPipeError:
        # Python's advice (signal module docs, SIGPIPE): point stdout at devnull so the flush at exit stays quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1  # as Python itself exits on EPIPE
    return code


def _version() -> str:
    """The installed distribution's version: pyproject.toml is the one place it is written."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trainwarden")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainwarden", description="Keep a PyTorch training run alive.")
    parser.add_argument("--version", action="version", version=f"trainwarden {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job config under supervision, in the foreground")
    run.add_argument("config", help="job config (YAML)")
    run.add_argument("--run-dir", help="run directory (overrides the config's run_dir)")
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a config key before validation (repeatable): KEY a dotted path, VALUE YAML, "
        "e.g. --set worker.save_checkpoint_steps=100",
    )
    run.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=None,
        help=f"events on stderr: console (readable, with a live status line on a terminal), json "
        f"(one object per line, as in the journal), or auto (default; {ENV_LOG_FORMAT}): console "
        f"on a terminal, json elsewhere",
    )
    run.add_argument(
        "--ignore-stop-file",
        action="store_true",
        help="launch although the stop file is present (its current content is not acted on)",
    )
    run.add_argument(
        "--take-over",
        action="store_true",
        help="for a batch script whose supervisor died on its live host without ending the run (killed, a Python "
        "error): take the run over here, wait as the job's keeper if a successor on another node took it first, "
        "or exit at once with the run's exit code if it ended",
    )
    run.add_argument("--successor", action="store_true", help=argparse.SUPPRESS)  # started by a node agent
    run.set_defaults(func=_run)
    status = sub.add_parser("status", help="where a run stands")
    status.add_argument("run_dir", help="the run directory")
    status.add_argument("--json", action="store_true", help="print the full status as JSON")
    status.add_argument(
        "--excluded-nodes",
        action="store_true",
        help="print only the nodes a multi-node run excludes, comma-separated (for sbatch --exclude)",
    )
    status.set_defaults(func=_status)
    stop = sub.add_parser("stop", help="ask a run to save a checkpoint and exit (or continue): writes its stop file")
    stop.add_argument("run_dir", help="the run directory")
    stop.add_argument(
        "--at-step", type=int, metavar="N", help="save at step N (default: the next step every rank can agree on)"
    )
    stop.add_argument(
        "--continue",
        dest="keep_going",
        action="store_true",
        help="keep training after the checkpoint (needs --at-step)",
    )
    stop.set_defaults(func=_stop)
    nodes = sub.add_parser("nodes", help="a multi-node run's node ledger: which nodes failed it, which are excluded")
    nodes.add_argument("run_dir", help="the run directory")
    nodes.add_argument(
        "--forget",
        metavar="NODE",
        action="append",
        default=[],
        help="clear every fault of NODE, so the run uses it again (repeatable)",
    )
    nodes.add_argument(
        "--sbatch-args",
        action="store_true",
        help="print only the sbatch options to resubmit with: a node range and the excluded nodes",
    )
    nodes.set_defaults(func=_nodes)
    export = sub.add_parser("export", help="write a checkpoint's model weights as a plain state_dict file")
    export.add_argument("run_dir", help="the run directory")
    export.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="PATH",
        help="the file to write (replaced atomically; a symlink there is replaced, not followed)",
    )
    export.add_argument(
        "--step",
        type=int,
        metavar="N",
        help="the checkpoint of step N (default: the newest usable one, as a resume would pick)",
    )
    export.add_argument("--prefix", help="the checkpoint file prefix (default: the only one in the run dir)")
    export.set_defaults(func=_export)
    plot = sub.add_parser(
        "plot",
        help="draw a run as one PNG: loss, steps/s, every event, per-rank step time (needs the plot extra: matplotlib)",
    )
    plot.add_argument("run_dir", help="the run directory")
    plot.add_argument(
        "-o", "--output", metavar="FILE", help="the PNG to write (default RUN_DIR/plot.png; replaced atomically)"
    )
    plot.set_defaults(func=_plot)
    return parser


def _run(args: argparse.Namespace) -> int:
    overrides = [*shlex.split(os.environ.get(ENV_SET, "")), *args.overrides]  # the command line has the last word
    try:
        config = load_config(args.config, overrides)
    except (ConfigError, ValueError) as exc:  # ValueError: TRAINWARDEN_SET is not shell words
        print(f"trainwarden: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        config = check_launchable(config)  # a missing script fails here once, not at every restart
    except ConfigError as exc:
        print(f"trainwarden: cannot launch: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        console = _console(args.log_format)
    except ValueError as exc:
        print(f"trainwarden: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    # Each node's agent checks its own GPUs. A run carried on within its job (a successor, a take-over) was checked at
    # its start: a job that lost nodes since is the launcher's to handle (fewer nodes, or exit 75 and the next job).
    carried_on = args.successor or args.take_over
    problem = (None if carried_on else _slurm_problem(config)) if _multi_node(config) else preflight(config)
    if problem:
        print(f"trainwarden: cannot launch: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    layout = RunLayout(Path(args.run_dir or config.run_dir).resolve())
    multi = _multi_node(config)
    try:
        lock = None if multi else lock_run_dir(layout)  # many nodes: the lease alone, a successor is elsewhere
        ttl_s = config.slurm.node_timeout_s if multi else LOCAL_TTL_S
        if args.take_over and not args.successor:
            lease = take_over(layout, ttl_s=ttl_s, say=_say, locked_here=lock is not None)
        else:
            lease = take_lease(layout, ttl_s=ttl_s, batch=not args.successor, locked_here=lock is not None)
    except RunDirBusy as exc:
        print(f"trainwarden: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (OSError, ValueError) as exc:
        return _unusable(layout, exc)
    if isinstance(lease, int):  # --take-over: the run's exit code (it ended, or a successor ended it)
        if lock is not None:
            lock.close()
        return lease
    if isinstance(lease, str):
        print(f"trainwarden: {lease}", file=sys.stderr)
        return EXIT_FAILED
    try:
        journal = open_journal(layout.journal, root=layout.root, echo=console or sys.stderr)
    except OSError as exc:  # a symlink, FIFO or directory where the supervisor's own files go
        if lock is not None:
            lock.close()
        return _unusable(layout, exc)
    try:
        supervisor = _supervise(config, layout, journal, args, lease, console)
    finally:
        journal.close()
        if lock is not None:
            lock.close()
        if console is not None:
            console.close()
    if isinstance(supervisor, int):  # unusable run dir, or the successor's exit code
        return supervisor
    code = supervisor.state.exit_code or 0
    _say_outcome(supervisor.state, layout)  # first: how it ended and why, then where the time went
    _say_goodput(layout)
    if args.successor:  # no batch script may be left to end the job as its exit code says
        end_job(
            layout,
            code,
            exclude=_excluded_now(layout, config),
            nodes=(config.min_nodes, config.nodes + config.spare_nodes),
            say=_say,
            controller_wait_s=config.slurm.controller_wait_s,
        )
    return code


def _supervise(
    config: JobConfig, layout: RunLayout, journal: Any, args: argparse.Namespace, lease: Lease, console: Console | None
) -> Supervisor | int:
    """Supervise, and after handing over (cut off, or deposed), wait: either the run is ours again, or the
    exit code is the successor's. The last supervisor that ran, or an exit code."""
    while True:
        factory: LauncherFactory = (
            functools.partial(SlurmLauncher, lease=lease, args=args.argv) if _multi_node(config) else LocalLauncher
        )
        try:
            supervisor = Supervisor(
                config,
                layout,
                journal,
                config_path=args.config,
                launcher=factory,
                lease=lease,
                ignore_stop_file=args.ignore_stop_file,
            )
        except OSError as exc:  # a symlink, FIFO or directory where the supervisor's own files go
            return _unusable(layout, exc)
        if console is not None:
            supervisor.status_listeners.append(console.status)
        # A Ctrl-C or SIGTERM after the run ended (a second press while the last words are written) is not the run's:
        # run() puts these dispositions back when it returns, so the process still exits with the run's code.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        if supervisor.run() is not None:
            return supervisor
        if not _multi_node(config):  # on one machine nobody hands over: another host took the run dir meanwhile
            _say(f"stopped supervising {layout.root}: {supervisor.handed_over}")
            return EXIT_FAILED
        outcome = wait_after_handover(layout, lease, say=_say)
        if isinstance(outcome, int):
            return outcome
        journal.log.warning(  # the run it handed over is its own again: nobody took it over, its link is back
            "supervisor_resumed",
            generation=outcome.generation,
            previous_generation=lease.generation,
            host=outcome.host,
            handed_over=supervisor.handed_over,
            attempt=supervisor.state.attempt,
        )
        lease = outcome


def _say(line: str) -> None:
    print(f"trainwarden: {line}", file=sys.stderr, flush=True)


def _multi_node(config: JobConfig) -> bool:
    return config.multi_node


def _slurm_problem(config: JobConfig) -> str | None:
    """Why a multi-node config cannot run here (outside a Slurm allocation, too few nodes), or None."""
    if not _multi_node(config):
        return None
    wanted = f"nodes: {config.nodes}" + (f" and spare_nodes: {config.spare_nodes}" if config.spare_nodes else "")
    if not in_allocation():
        return f"{wanted} needs a Slurm allocation: run it inside sbatch or salloc (SLURM_JOB_ID is not set)"
    try:
        nodes = allocation()
    except SlurmError as exc:
        return str(exc)
    if len(nodes) < config.nodes:
        return f"{wanted}, but the allocation has {len(nodes)} node(s): {', '.join(nodes)}"
    return None


def _excluded_now(layout: RunLayout, config: JobConfig) -> list[str]:
    """The nodes the ledger excludes now, for a requeue or a resubmission."""
    try:
        ledger = Ledger.load(layout)
    except (OSError, ValueError):
        return []
    return sorted(ledger.excluded(time.time(), **config.slurm.ledger_rules))


def _console(requested: str | None) -> Console | None:
    """For people: events rendered readably and, on a terminal, the live status line; None: JSON lines."""
    if choose_format(requested, sys.stderr) == "json":
        return None
    try:
        live = sys.stderr.isatty()
    except (AttributeError, ValueError):
        live = False
    return Console(sys.stderr, live=live)


def _say_outcome(state: State, layout: RunLayout) -> None:
    """How the run ended and why, with where the rank logs are; then, on a line of its own, the cause of the last
    failed attempt."""
    if state.phase is Phase.FINISHED:
        print(
            f"trainwarden: run finished: every rank exited 0 (attempt {state.attempt}, "
            f"{state.restarts} restart{'' if state.restarts == 1 else 's'})",
            file=sys.stderr,
        )
        return
    logs = layout.attempt_log(state.attempt, 0, "err").parent
    reason = state.reason or ""
    cause = state.cause if state.failures and state.failures[-1].attempt == state.attempt else None  # not a launch's
    if cause and reason.endswith(f": {cause}"):  # a crash loop's reason ends with the cause: say it once
        reason = reason.removesuffix(f": {cause}")
    outcome = "run " + shown_state(state.phase.value, state.exit_code)  # 75: interrupted (resubmit)
    where = f" (rank logs: {logs})" if logs.is_dir() and state.exit_code else ""  # none before a launch
    print(f"trainwarden: {outcome}: {reason}{where}", file=sys.stderr)
    if cause and state.exit_code:
        print(f"trainwarden: cause: {cause}", file=sys.stderr)


def _say_goodput(layout: RunLayout) -> None:
    """Where the run's time went (all supervisors of the run dir together), from the state file written last; and
    whether the last attempt's resume was not exact."""
    try:
        status = read_status(layout)
    except StatusError:
        return
    if line := describe_goodput(status.get("goodput")):
        print(f"trainwarden: {line}", file=sys.stderr)
    inexact = status.get("resume_inexact")
    if isinstance(inexact, list) and inexact:
        print(
            f"trainwarden: resume not exact, {len(inexact)} reason(s): trainwarden status {layout.root}",
            file=sys.stderr,
        )


def _unusable(layout: RunLayout, exc: OSError | ValueError) -> int:
    """The run dir holds something that must not be written through; retrying cannot help."""
    where, why = (exc.filename or "", exc.strerror or exc) if isinstance(exc, OSError) else ("", exc)
    print(f"trainwarden: cannot use run dir {layout.root}: {where}: {why}", file=sys.stderr)
    return EXIT_CONFIG


def _status(args: argparse.Namespace) -> int:
    try:
        status = read_status(RunLayout(Path(args.run_dir)))
    except StatusError as exc:
        print(f"trainwarden: {exc}", file=sys.stderr)
        return 2
    if args.excluded_nodes:
        nodes = status.get("excluded_nodes") or []
        print(",".join(str(node) for node in nodes if isinstance(node, str) and node.isprintable()))
    else:
        status = _with_node_standing(RunLayout(Path(args.run_dir)), status)
        print(json.dumps(status, indent=1) if args.json else render(status))
    return 0


def _with_node_standing(layout: RunLayout, status: dict[str, Any]) -> dict[str, Any]:
    """Each excluded node's standing as `trainwarden nodes` gives it now: one truth for both commands, the ledger's
    verdict with Slurm's view where Slurm answers here. (The state file's was worked out when it was written, with
    Slurm's states from before the attempt: a node Slurm marked down since would still read "cooling down".)"""
    nodes = status.get("nodes")
    excluded = (
        [n for n in nodes if isinstance(n, dict) and n.get("state") == "excluded"] if isinstance(nodes, list) else []
    )
    if not excluded:
        return status
    try:
        ledger = Ledger.load(layout)
    except (OSError, ValueError):
        return status
    policy = _ledger_policy(layout)
    rules = {k: policy[k] for k in SlurmConfig().ledger_rules}
    states = _slurm_states({fault.node for fault in ledger.faults})
    rows = {row["node"]: row for row in ledger.rows(time.time(), **rules, slurm_states=states)}
    for node in excluded:
        row = rows.get(node.get("node"))
        if row is not None:
            node["why"] = row["reason"] if row["status"] != USABLE else "usable again from the next attempt"
    return status


def _stop(args: argparse.Namespace) -> int:
    if args.at_step is not None and args.at_step <= 0:
        print("trainwarden: --at-step must be a step number above 0", file=sys.stderr)
        return 2
    if args.keep_going and args.at_step is None:
        print("trainwarden: --continue needs --at-step N (the stop file says -N)", file=sys.stderr)
        return 2
    layout = RunLayout(Path(args.run_dir).resolve())
    problem = _not_stoppable(layout)
    if problem:
        print(f"trainwarden: {problem}", file=sys.stderr)
        return 1
    path = layout.default_stop_file
    content = "" if args.at_step is None else f"{-args.at_step if args.keep_going else args.at_step}"
    try:
        atomic_write_bytes(path, f"{content}\n".encode(), root=layout.root)
    except (OSError, ValueError) as exc:
        print(f"trainwarden: cannot write {path}: {exc}", file=sys.stderr)
        return 1
    when = "at the next step every rank can agree on" if args.at_step is None else f"at step {args.at_step}"
    then = "continue" if args.keep_going else "exit"
    idle = _no_rank_running(layout)
    if idle is None:
        print(f"wrote {content or '(empty)'} to {path}: the run saves a checkpoint {when}, then {then}s")
    elif args.keep_going:
        print(
            f"wrote {content} to {path}: but no rank is running ({idle[0]}): nothing can be saved now, so the "
            "supervisor drops this save-and-continue order (stop_request_dropped)"
        )
    else:
        print(
            f"wrote {content or '(empty)'} to {path}: no rank is running ({idle[0]}), so none can save now: {idle[1]}"
        )
    # One rule for every later start (a requeue, a resubmission, systemd, a successor): the file is kept.
    until = "once that checkpoint is saved, remove it" if args.keep_going else "to go on later, remove it"
    print(
        f"the stop file stays: while it is there, a new start of this run dir (a requeue, a resubmission, a "
        f"restart) launches nothing and exits 0; {until} (rm {path}) or start with --ignore-stop-file"
    )
    return 0


def _nodes(args: argparse.Namespace) -> int:
    """The ledger of a multi-node run, with Slurm's view of each node where Slurm can be asked."""
    layout = RunLayout(Path(args.run_dir).resolve())
    if not layout.lock_file.parent.is_dir() or layout.lock_file.parent.is_symlink():
        print(f"trainwarden: {layout.root} is not a trainwarden run dir (no supervisor/ folder in it)", file=sys.stderr)
        return 1
    now = time.time()
    try:
        for node in args.forget:
            update_ledger(layout, functools.partial(Ledger.forgiven, node=node, now=now))
            print(
                f"forgot every fault of {node}: this run may use it again (a running supervisor does so from "
                "its next attempt on)"
            )
        ledger = Ledger.load(layout)
    except (OSError, ValueError) as exc:
        print(f"trainwarden: {layout.node_ledger}: {exc}", file=sys.stderr)
        return 1
    policy = _ledger_policy(layout)
    states = _slurm_states({fault.node for fault in ledger.faults})
    rules = {k: policy[k] for k in SlurmConfig().ledger_rules}
    if args.sbatch_args:
        excluded = sorted(ledger.excluded(now, **rules, slurm_states=states))
        # A run that may shrink (slurm.min_nodes) may also start on fewer nodes: Slurm gives what it has.
        low = min(policy["min_nodes"], policy["nodes"]) or policy["nodes"]
        high = policy["nodes"] + policy["spare_nodes"]
        if missing := _partition_shortfall(excluded, low):  # a job that could never start is not submitted
            print(f"trainwarden: no job to submit: {missing}", file=sys.stderr)
            return 1
        print(
            f"--nodes={low}"
            + (f"-{high}" if high > low else "")
            + (f" --exclude={','.join(excluded)}" if excluded else "")
        )
    elif not args.forget:
        print(render_rows(ledger.rows(now, **rules, slurm_states=states)))
    return 0


def _partition_shortfall(excluded: list[str], minimum: int) -> str | None:
    """What the partition lacks for a job of `minimum` nodes away from `excluded`, where Slurm answers (`sinfo`)."""
    try:
        return shortfall(excluded, minimum, timeout=PING_TIMEOUT_S)
    except SlurmError:
        return None  # no Slurm here (a laptop), or its controller is out of reach: sbatch has the last word


def _ledger_policy(layout: RunLayout) -> dict[str, Any]:
    """The run's ledger rules and node counts, as its supervisor last wrote them (defaults if it never did)."""
    policy: dict[str, Any] = {**SlurmConfig().ledger_rules, "nodes": 1, "spare_nodes": 0, "min_nodes": 0}
    try:
        written = read_status(layout).get("node_policy") or {}
    except StatusError:
        return policy
    for key, value in policy.items():  # the state file is untrusted: each value of its type, or the default
        got = written.get(key) if isinstance(written, dict) else None
        if type(got) is type(value) or (isinstance(value, float) and type(got) is int):
            policy[key] = got
    return policy


def _slurm_states(nodes: set[str]) -> dict[str, str]:
    """Slurm's state of `nodes` where Slurm answers here (a login node, a job); {} elsewhere."""
    if not nodes:
        return {}
    try:
        return node_states(nodes)
    except SlurmError:
        return {}


def _export(args: argparse.Namespace) -> int:
    try:
        exported = export_weights(args.run_dir, args.output, step=args.step, prefix=args.prefix)
    except ExportError as exc:
        print(f"trainwarden: {exc}", file=sys.stderr)
        return exc.exit_code
    for step, why in exported.passed_over:
        print(f"trainwarden: passed over step {step}: {why}", file=sys.stderr)
    where = "" if exported.source == "checkpoint" else f"{exported.source}, "
    print(f"exported step {exported.step} of {args.run_dir} ({where}{exported.tensors} tensors) to {args.output}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from supervisor.observe.plot import PlotError, plot_run  # here: only this command pays for matplotlib

    try:
        summary, notes = plot_run(Path(args.run_dir), None if args.output is None else Path(args.output))
    except PlotError as exc:
        print(f"trainwarden: {exc}", file=sys.stderr)
        return 1
    for note in notes:
        print(f"trainwarden: plot: {note}", file=sys.stderr)
    print(summary)
    return 0


JOURNAL_TAIL_BYTES = 1 << 20  # where `stop` looks for agents that fenced the ranks of the attempt the state file lists


def _no_rank_running(layout: RunLayout) -> tuple[str, str] | None:
    """(why no rank can save for a stop now, where the run then ends), from the state file; None while ranks run
    (or nothing says otherwise: a run that never wrote its state, one that ended)."""
    try:
        status = read_status(layout)
    except StatusError:
        return None
    state = status.get("state")
    found = status.get("ranks")
    ranks: list[Any] = found if isinstance(found, list) else []
    if state in ("finished", "stopped", "failed"):
        return None
    if not status.get("supervisor_alive"):
        why = "no supervisor holds the run now: a takeover or a restart is under way"
    elif _taken_over_unwritten(status):
        why = "a new supervisor has just taken the run over and launched no rank yet"
    elif state in ("starting", "backoff"):
        why = f"the run is between attempts: {state}"
    elif state == "stopping" and not status.get("stop_order"):
        why = "the ranks of a failed attempt are going down"
    elif not any(isinstance(r, dict) and r.get("pid") is not None and r.get("returncode") is None for r in ranks):
        why = "every rank has exited"
    elif fenced := _fenced(layout, status.get("attempt")):
        why = f"the agents on {fenced} fenced their ranks: they lost the supervisor, a takeover is under way"
    else:
        return None
    checkpoint = status.get("last_checkpoint")
    newest = checkpoint.get("step") if isinstance(checkpoint, dict) else None
    if "newest_state" in status:  # the supervisor's own answer while no rank runs (a memory snapshot's step too)
        newest = status["newest_state"]
    elif (found := _newest_complete(layout, status, len(ranks))) is not None:
        newest = found  # as the next supervisor will find it: a save may have completed after the state was written
    progress = status.get("progress")
    heard = progress.get("step") if isinstance(progress, dict) else None
    if type(newest) is not int:
        return why, "no checkpoint is complete, so the run ends with nothing saved and starts again from its beginning"
    past = f", up to step {heard} (the last heard)," if type(heard) is int and heard > newest else ""
    return why, (
        f"the run ends stopped at its newest complete state, step {newest}; the steps trained past it{past} are lost"
    )


def _newest_complete(layout: RunLayout, status: dict[str, Any], ranks: int) -> int | None:
    """The newest state complete on every rank in the run dir (and this machine's memory tier), as a supervisor
    starting now would find it; None when the state file does not say the prefix and world size, or none is."""
    prefix, world = status.get("checkpoint_prefix"), status.get("world_size") or ranks
    if not isinstance(prefix, str) or type(world) is not int or world < 1:
        return None
    try:
        memory = check_memory_dir(memory_dir_for(layout.root))
    except OSError:
        memory = None
    try:
        found = newest_complete(replace(layout, memory=memory).checkpoint_stores(), world, prefix)
    except (OSError, ValueError):
        return None
    return None if found is None else found[1]


def _fenced(layout: RunLayout, attempt: Any) -> str | None:
    """The nodes whose agents fenced the ranks of `attempt` (`agent_fenced` in the journal's tail: they lost the
    supervisor), or None. Until the supervisor's lease lapses the state file still lists those ranks as running; with
    one node's ranks gone, no rank can save at a step every rank agrees on."""
    if type(attempt) is not int:
        return None
    try:
        with layout.journal.open("rb") as journal:
            journal.seek(max(0, journal.seek(0, os.SEEK_END) - JOURNAL_TAIL_BYTES))
            tail = journal.read().decode(errors="replace")
    except OSError:
        return None
    nodes = set()
    for line in tail.splitlines():
        if '"agent_fenced"' not in line:
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "agent_fenced" and event.get("attempt") == attempt:
            nodes.add(str(event.get("node"))[:100])
    return ", ".join(sorted(nodes)) or None


def _taken_over_unwritten(status: dict[str, Any]) -> bool:
    """Whether the lease is held by a newer generation than the supervisor that wrote the state file: a successor
    (or a fresh supervisor on the batch host) that has not written its state yet, so has launched no rank; the
    state file's ranks are its predecessor's, fenced or gone with their host."""
    holder = status.get("supervisor")
    generation = holder.get("generation") if isinstance(holder, dict) else None
    wrote = status.get("lease_generation")
    return type(generation) is int and type(wrote) is int and generation > wrote


def _not_stoppable(layout: RunLayout) -> str | None:
    """Why `trainwarden stop` must not write RUN_DIR/stop here, or None. It writes nowhere else: a path
    read from the run dir (state.json's stop_file) is only named in the message, never written."""
    if not layout.root.is_dir() or not layout.lock_file.parent.is_dir() or layout.lock_file.parent.is_symlink():
        return f"{layout.root} is not a trainwarden run dir (no supervisor/ folder in it); nothing written"
    try:
        watched = read_status(layout).get("stop_file")
    except StatusError:
        return None  # a run whose supervisor never wrote its state: the default stop file is the one
    if isinstance(watched, str) and watched != str(layout.default_stop_file):
        return (
            f"this run watches the stop file {watched[:300]!r} (stop.stop_file_path), not "
            f"{layout.default_stop_file}; write that file instead, e.g. touch it; nothing written"
        )
    return None


if __name__ == "__main__":
    sys.exit(main())
