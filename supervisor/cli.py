"""The `trainwarden` command: `run` a job under supervision, `status` of a run dir, `stop` it gracefully."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from supervisor.config import ConfigError, load_config
from supervisor.journal import open_journal
from supervisor.runner import RunDirBusy, Supervisor, lock_run_dir
from supervisor.status import StatusError, read_status, render
from worker.contract import EXIT_CONFIG, EXIT_FAILED, RunLayout, atomic_write_bytes

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    return args.func(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainwarden", description="Keep a PyTorch training run alive.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job config under supervision, in the foreground")
    run.add_argument("config", help="job config (YAML)")
    run.add_argument("--run-dir", help="run directory (overrides the config's run_dir)")
    run.add_argument("--ignore-stop-file", action="store_true",
                     help="launch although the stop file is present (its current content is not acted on)")
    run.set_defaults(func=_run)
    status = sub.add_parser("status", help="where a run stands")
    status.add_argument("run_dir", help="the run directory")
    status.add_argument("--json", action="store_true", help="print the full status as JSON")
    status.set_defaults(func=_status)
    stop = sub.add_parser("stop", help="ask a run to save a checkpoint and exit (or continue): writes its stop file")
    stop.add_argument("run_dir", help="the run directory")
    stop.add_argument("--at-step", type=int, metavar="N", help="save at step N (default: the next step every "
                                                                 "rank can agree on)")
    stop.add_argument("--continue", dest="keep_going", action="store_true",
                      help="keep training after the checkpoint (needs --at-step)")
    stop.set_defaults(func=_stop)
    return parser


def _run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"trainwarden: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    layout = RunLayout(Path(args.run_dir or config.run_dir).resolve())
    try:
        lock = lock_run_dir(layout)
    except RunDirBusy as exc:
        print(f"trainwarden: {exc}", file=sys.stderr)
        return EXIT_FAILED
    journal = open_journal(layout.journal)
    try:
        supervisor = Supervisor(config, layout, journal, config_path=args.config,
                                ignore_stop_file=args.ignore_stop_file)
        code = supervisor.run()
    finally:
        journal.close()
        lock.close()
    if code != 0:
        logs = layout.attempt_log(supervisor.state.attempt, 0, "err").parent
        print(f"trainwarden: run failed: {supervisor.state.reason} (rank logs: {logs})", file=sys.stderr)
    return code


def _status(args: argparse.Namespace) -> int:
    try:
        status = read_status(RunLayout(Path(args.run_dir)))
    except StatusError as exc:
        print(f"trainwarden: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(status, indent=1) if args.json else render(status))
    return 0


def _stop(args: argparse.Namespace) -> int:
    if args.at_step is not None and args.at_step <= 0:
        print("trainwarden: --at-step must be a step number above 0", file=sys.stderr)
        return 2
    if args.keep_going and args.at_step is None:
        print("trainwarden: --continue needs --at-step N (the stop file says -N)", file=sys.stderr)
        return 2
    layout = RunLayout(Path(args.run_dir).resolve())
    path = _stop_file_of(layout)
    content = "" if args.at_step is None else f"{-args.at_step if args.keep_going else args.at_step}"
    try:
        atomic_write_bytes(path, f"{content}\n".encode())
    except OSError as exc:
        print(f"trainwarden: cannot write {path}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    when = "at the next step every rank can agree on" if args.at_step is None else f"at step {args.at_step}"
    then = "continue" if args.keep_going else "exit"
    print(f"wrote {content or '(empty)'} to {path}: the run saves a checkpoint {when}, then {then}s")
    return 0


def _stop_file_of(layout: RunLayout) -> Path:
    """The stop file the run's supervisor watches (from its status), else the default one in the run dir."""
    try:
        return Path(read_status(layout)["stop_file"])
    except (StatusError, KeyError, TypeError):
        return layout.default_stop_file


if __name__ == "__main__":
    sys.exit(main())
