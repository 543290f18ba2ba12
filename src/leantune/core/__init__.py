"""What every layer above may use and that knows nothing of data, models or methods: writing
files (`writes`), digests and the cache's home (`digests`), precision and devices (`precision`),
optimizers and schedules (`optim`), the chunked cross-entropy kernel (`chunked_ce`), random state
(`rng`), signals (`signals`), the host's threads and allocator (`threads`, `allocator`), and
the process's resident memory (`process_memory`)."""
