"""The `leantune` command: a thin layer over the library (`app` builds the parser and runs a
command; `args`, `inference` and `prepare` hold command groups; `crash` the top-level handler)."""
