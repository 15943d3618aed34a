"""The replay engine: `model` (loading, precision, determinism), `limits` (budgets, context, cache kinds),
`decode` (the live decode loop), `cache` (snapshot, fingerprint, bitwise compare), `transplant` (K/V surgery),
`boundary` (where stage 1 ends), `diagnostics` (margins, logit and cache differences), and `lm` (the `LM`
facade that builds boundary states and continues from them)."""
