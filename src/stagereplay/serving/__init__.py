"""The engines that keep their own caches (vLLM, llama.cpp, a server over HTTP), behind one seam (`seam`: what an
engine must offer), by name in `engines` (its registry), with what a run's arms need of them (`arms`: the engine
loaded for a run, whether a served arm was built as named) and the audit (`replay`). No experiment is named here: each
experiment's package says how an engine serves it. Adding an engine is a module here and one line of
`engines.ENGINES`."""
