"""Observers: bookkeeping beside the decision core that never changes a decision (progress, goodput, stragglers),
and what people and machines see of a run (console, status, metrics, systemd notifications, the plot).

A new observer goes here: it implements `progress.Observer` and the runner shows it every event once decided."""
