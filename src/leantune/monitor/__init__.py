"""Watching a run: per-step figures beyond the loss, and the backends that export them.

step_stats.py   padding, MFU, data wait, ETA, CPU and memory of every metrics record
flops.py        FLOPs per token of a method, and the matmul peak a run measures once
gpu.py          GPU utilisation and memory through NVML, when nvidia-ml-py is installed
prometheus.py   the `PrometheusSink`: the loop's records as Prometheus metrics
server.py       the HTTP endpoint (/metrics, /health) the sink serves them on
"""
