"""From ledger records to what people read: `stats` (intervals, tests), `summaries` and `diagnostics` (each
experiment's table from its records), `results` (results.json), `format` (numbers, `Table`), `tables`,
`resample_tables`, `verdict`, `figures`, `diagnostic_figures`, `html`, `explorer` (the per-item HTML),
`render` (Markdown, terminal, report files), `export` (Parquet / CSV)."""
