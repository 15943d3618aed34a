"""mismatch: a rollout's tokens scored by the rollout engine and by a trainer on the same token IDs. The experiment
(`experiment`), its payloads (`payloads`), its item function (`item`), its metrics (`stats`, `fields`, `metrics`, and
verl's own quantities, `verl`), its summary, tables, verdict and story (`summary`, `tables`, `verdict`, `story`), and
two runs compared (`compare`)."""

from stagereplay.experiments.mismatch.metrics import mismatch_metrics

__all__ = ["mismatch_metrics"]
