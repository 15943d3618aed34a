"""What a run costs before it runs (`paper`: the forwards, caches and hours of each stage, from the model's
config; `stages`: the stages a command makes; `rates`: tokens per second, given or measured), and what a
recorded run did (`recorded`)."""
