"""The experiments, a package per family, each experiment one typed object (`core.experiment.Experiment`) found by
name in one registry (`core.registry`, loaded from the `stagereplay.experiments` entry points):

    core        the `Experiment` base, jobs, the prepared run and its engine, the verdict's questions, figures, the
                statistics and number formats of the summaries, the registry
    protocol    the reference paper's experiments: matched, precision_2x2, bridge, transplant, resample, their
                arms and diagnostics, and `paper`, the protocol as its steps
    mismatch    a rollout's tokens scored by the rollout engine and by a trainer (training-inference mismatch)
    attest      is a server running the model it claims

Each family's package holds what its experiments record, summarize, tabulate and compare, and how a serving engine
runs them; no other room names its types."""
