"""The `trainwarden` command: `run` a job under supervision, `status` of a run dir."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from supervisor.config import ConfigError, load_config
from supervisor.journal import open_journal
from supervisor.runner import RunDirBusy, Supervisor, lock_run_dir
from supervisor.status import StatusError, read_status, render
from worker.contract import EXIT_CONFIG, EXIT_FAILED, RunLayout

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
    run.set_defaults(func=_run)
    status = sub.add_parser("status", help="where a run stands")
    status.add_argument("run_dir", help="the run directory")
    status.add_argument("--json", action="store_true", help="print the full status as JSON")
    status.set_defaults(func=_status)
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
        supervisor = Supervisor(config, layout, journal, config_path=args.config)
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


if __name__ == "__main__":
    sys.exit(main())
