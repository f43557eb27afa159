"""`python -m supervisor` is the `trainwarden` command."""

import sys

from supervisor.cli import main

sys.exit(main())
