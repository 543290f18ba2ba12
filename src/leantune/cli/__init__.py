"""The `leantune` command: a thin layer over the library. `app` builds the parser from the
command groups (`train`, `prepare`, `inference`, `bench`, `monitor`: their flags, importing no
torch) and runs a command; `commands/` holds what each command does; `args` the flag types and
help formatters the groups share; `crash` the handler of an internal error."""
