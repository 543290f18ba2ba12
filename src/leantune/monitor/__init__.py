"""Monitoring: the optional sinks (TensorBoard, W&B, MLflow) and the run report.

Each backend's module is imported only when its `monitor.*` setting is on
(`monitor.backends`); the report reads nothing but the run directory (`monitor.report`).
"""
