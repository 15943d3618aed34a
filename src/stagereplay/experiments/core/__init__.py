"""What every experiment shares: the `Experiment` base (`experiment`), jobs and their execution (`jobs`), the prepared
run and the engine that runs it (`prepared`), the verdict's questions (`verdict`), the charts figures are drawn with
(`figures`), the statistics and number formats of the summaries (`stats`, `format`, `diagnostics_summary`), a
comparison of two runs (`compared`), a recorded unit's lengths (`lengths`), the smallest runs (`small_run`), the
ledger schema page's tables (`payload_doc`), and the registry (`registry`)."""
