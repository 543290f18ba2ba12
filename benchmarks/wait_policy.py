"""OpenMP wait policy under contention, without leantune: a linear + LoRA forward/backward loop
(1024 x 576 -> 1536, rank 16, SiLU) in a fresh process per arm, iterations/s, idle and beside 1
and 2 busy cores (single-threaded numpy loops, killed after each arm). Arms: 2 threads with
libgomp's default wait (spin, then sleep), OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=10000, and 1
thread. The policy is read when torch loads libgomp, hence a process per arm. One JSON line last.

    python benchmarks/wait_policy.py --seconds 4 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

LOOP = """
import os, time, torch
torch.set_num_threads(int(os.environ["PROBE_THREADS"]))
torch.manual_seed(0)
x = torch.randn(1024, 576, requires_grad=True)
lin = torch.nn.Linear(576, 1536)
a = torch.randn(576, 16, requires_grad=True)
b = torch.randn(16, 1536, requires_grad=True)
def step():
    h = lin(x) + (x @ a) @ b
    (torch.nn.functional.silu(h) * h).sum().backward()
for _ in range(3):
    step()
n, t = 0, time.perf_counter()
while time.perf_counter() - t < float(os.environ["PROBE_SECONDS"]):
    step()
    n += 1
print(n / (time.perf_counter() - t))
"""
BUSY = "import numpy as np\na = np.random.rand(1 << 16)\nwhile True:\n    a = a * 1.000001 + 1e-9\n"
ARMS = {  # name: (threads, environment)
    "2 threads, default wait": ("2", {}),
    "2 threads, OMP_WAIT_POLICY=PASSIVE": ("2", {"OMP_WAIT_POLICY": "PASSIVE"}),
    "2 threads, GOMP_SPINCOUNT=10000": ("2", {"GOMP_SPINCOUNT": "10000"}),
    "1 thread": ("1", {}),
}


def arm(threads: str, extra: dict[str, str], busy: int, seconds: float) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                                                            "GOMP_SPINCOUNT")}  # fmt: skip
    env.update(extra, PROBE_THREADS=threads, PROBE_SECONDS=str(seconds))
    quiet = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", BUSY], env=quiet) for _ in range(busy)]
    try:
        time.sleep(0.3)
        out = subprocess.run([sys.executable, "-c", LOOP], env=env, capture_output=True, text=True)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return float(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=4.0, help="timed loop per arm")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--busy", default="0,1,2")
    args = p.parse_args()
    results: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for busy in (int(b) for b in args.busy.split(",")):
            for name, (threads, extra) in ARMS.items():
                its = arm(threads, extra, busy, args.seconds)
                key = f"busy {busy}, {name}"
                results.setdefault(key, []).append(round(its, 2))
                load = os.getloadavg()[0]
                print(f"{key:48s} {its:7.2f} it/s  (load {load:.1f})", file=sys.stderr)
    print(json.dumps({"benchmark": "wait_policy", "cpus": os.cpu_count(), "its_per_s": results}))


if __name__ == "__main__":
    main()
