"""The replay engine: `model` (loading, precision, determinism), `decode` (the live decode loop), `cache`
(snapshot, fingerprint, bitwise compare), `transplant` (K/V surgery), `boundary` (where stage 1 ends), and
`lm` (the `LM` facade that builds boundary states and continues from them)."""
