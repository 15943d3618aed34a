"""From ledger records to what people read: `stats` (intervals, tests), `summaries` (each experiment's table
from its records), `results` (results.json), `tables`, `figures`, `html` and `render` (Markdown, terminal,
report files), `export` (Parquet / CSV)."""
