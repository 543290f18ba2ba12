"""Monitoring: watch a run while it writes its run directory, and read it afterwards.

step_stats.py   padding, MFU, data wait, ETA, CPU and memory of every metrics record
flops.py        FLOPs per token of a method, and the matmul peak a run measures once
gpu.py          GPU utilisation and memory through NVML, when nvidia-ml-py is installed
prometheus.py   the `PrometheusSink`: the loop's records as Prometheus metrics
server.py       the HTTP endpoint (/metrics, /health) the sink serves them on
backends.py     the optional sinks (TensorBoard, W&B, MLflow), imported only when configured
summary.py      summary.json: its one writer and reader
report*.py      report.html, from the run directory only
dashboard/      `leantune dashboard`: live charts of the runs in a folder
"""
