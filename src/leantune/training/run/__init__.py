"""The run directory: its files and record (`rundir`), the fingerprint that decides whether a
run may resume (`fingerprint`, `resume`), its summary (`summary`) and writes refused on the
way out (`refused_writes`)."""
