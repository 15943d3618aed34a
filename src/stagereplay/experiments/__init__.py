"""The protocol's experiments, each one typed object (`experiment.Experiment`) in one registry (`registry`): its item
function, typed job parameters, what verify, the audit and plan ask of it, and its summary and tables. Beside them:
the arm and comparison records every experiment writes (`arms`), the per-item diagnostics (`diagnose`), the
statistics and number formats of the summaries (`stats`, `format`, `diagnostics_summary`), job execution (`jobs`)
and the transplant selection (`selection`)."""
