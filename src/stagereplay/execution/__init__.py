"""Where item jobs run: `config` (settings, the job type), `local` (this process or a worker pool),
`ray_cluster` (one model replica per Ray actor), `jobs` (the dispatcher the experiments call)."""
