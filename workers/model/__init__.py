"""The model a worker runs: loading (sources, GGUF, tiny test models), the runner, paged KV attention and its decode layouts, tensor parallelism, and the check against eager attention."""
