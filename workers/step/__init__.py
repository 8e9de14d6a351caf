"""One worker's step: the request mirror, the step that runs ahead of the coordinator, the compute thread, and the worker that ties them to a model and a sampler."""
