"""Monitoring: watch a run while it writes its run directory, and read it afterwards."""
