"""The engines that keep their own caches (vLLM, llama.cpp), behind one seam (`seam`: the registry and what an
engine must offer), and the arms of the protocol they run (`matched`, `precision_2x2`, `restore`, `jobs`). Adding
an engine is a module here and one line of `seam.ENGINES`."""
