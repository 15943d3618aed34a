"""The reference paper's experiments: `matched`, `precision_2x2`, `bridge`, `transplant` and `resample`, each with its
summary; the arm and comparison records they write (`arms`), the per-item diagnostics (`diagnose`), the transplant
selection (`selection`), and `paper`, the protocol as its steps."""
