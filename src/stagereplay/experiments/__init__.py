"""The protocol's experiments, each one typed object (`experiment.Experiment`) in one registry (`registry`): its item
function, typed job parameters, what verify, the audit and plan ask of it, and its summary, tables, verdict facts and
figures. Beside them: the arm and comparison records every experiment writes (`arms`), the per-item diagnostics
(`diagnose`), the statistics and number formats of the summaries (`stats`, `format`, `diagnostics_summary`), the
verdict's questions (`verdict`), the charts figures are drawn with (`figures`), job execution (`jobs`), the transplant
selection (`selection`), and `paper`, the reference paper's protocol as its steps."""
