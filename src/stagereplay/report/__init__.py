"""From ledger records to what people read: `results` (results.json, each stage's sections as its experiment
summarises them), `tables` (each experiment's tables, the diagnostics of compared pairs, the audit's), `verdict`,
`figures`, `diagnostic_figures`, `html`, `explorer` (the per-item HTML), `render` (Markdown, terminal, report files),
`export` (Parquet / CSV), `audit_lines`. The statistics, summaries and tables an experiment declares live with it
(`stagereplay.experiments`)."""
