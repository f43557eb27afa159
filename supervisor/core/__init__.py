"""The pure decision core: `decide(state, event, now) -> (state, actions)`, and the rules it applies.

Nothing here reads a file, starts a process or looks at a clock (an import-linter contract keeps it so):
`model` holds the events, actions and state; `decide` the transitions; `causes`, `hangs`, `blame`, `rollback`, `devices`
and `stop_requests` one failure class's rule each. The runner is its one way in: it turns what the launchers and
watchers see into events, and carries out the actions.
"""

from supervisor.core.decide import crash_loop, decide, saves_end, stopping_on_request
from supervisor.core.model import *  # noqa: F403  (the vocabulary: model.__all__)
from supervisor.core.model import __all__ as _model_all

__all__ = ["crash_loop", "decide", "saves_end", "stopping_on_request", *_model_all]
