"""Monitoring: watch a run while it writes its run directory, and read it afterwards.

The optional sinks (TensorBoard, W&B, MLflow) are imported only when their `monitor.*` setting
is on (`monitor.backends`); the run report and the dashboard read nothing but run directories.
"""
