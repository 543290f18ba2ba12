"""`leantune prepare`: clean, validate, dedup, tokenise once, pack, shard (local or Dask)."""
