"""The paper's experiments, each a library function over a run directory (the CLI wraps them)."""
