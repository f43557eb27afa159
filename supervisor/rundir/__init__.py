"""The run directory's files, each read with a size cap and never through a symlink or FIFO: the journal, the ranks'
logs, checkpoint records and the resume choice, heartbeat and stop-file watching, the supervisor's lease."""
