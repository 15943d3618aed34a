"""What a run leaves behind: `ledger` (manifest, hash-chained records, lock, resume, atomic writes),
`provenance` (versions, commit, hashes, device), `shards` (split a run for batch schedulers, merge it back)."""
