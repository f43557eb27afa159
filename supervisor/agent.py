"""`python -m supervisor.agent`: the node agent's entry point (the agent itself is `supervisor.launch.agent`)."""

import sys

from supervisor.launch.agent import main

if __name__ == "__main__":
    sys.exit(main())
