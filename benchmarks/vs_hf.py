"""leantune against HF Trainer + PEFT on the same work: `python benchmarks/vs_hf.py --help`.

The benchmark itself is `leantune.bench.throughput` (also `leantune bench throughput`).
"""

from leantune.bench.throughput import main

if __name__ == "__main__":
    raise SystemExit(main())
