"""What is checked after a run: the model-free checks of its ledger and manifest (`verify`), the re-execution of
its records (`reexecute`), and finding its inputs where they moved (`relocate`)."""
