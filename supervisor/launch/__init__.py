"""Launching and controlling processes: the local launcher and warm standbys, rank process trees and their stacks,
GPU health, and multi-node runs (Slurm job steps, the node agent and its wire protocol, the supervisor's succession).

A new launcher goes here, behind `launcher.Launcher`; the runner drives it and the core never learns which it is."""
