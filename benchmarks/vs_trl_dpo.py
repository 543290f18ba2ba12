"""leantune's DPO against TRL's DPOTrainer, same pairs: `python benchmarks/vs_trl_dpo.py --help`.

The benchmark itself is `leantune.bench.preference` (also `leantune bench preference`).
"""

from leantune.bench.preference import main

if __name__ == "__main__":
    raise SystemExit(main())
