"""Runners that stand in for a model: random logits for coordinator tests, a modelled GPU step time for scale-out benches."""
