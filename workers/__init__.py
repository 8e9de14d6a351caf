"""What runs on a GPU: batch mirror, sampler, model runner, the worker and its Ray wrapper."""
