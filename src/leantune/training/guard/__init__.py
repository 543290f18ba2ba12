"""The stability guard and out-of-memory recovery: the detectors (`detect`), what the loop does
about a verdict (`actions`), divergence records (`divergence`) and OOM replay (`oom`)."""
