"""What runs on a GPU (or a CPU): the worker's step (batch mirror), its sampler and model runner.
Its Ray wrapper is ``cluster.ray.worker_actor``."""
