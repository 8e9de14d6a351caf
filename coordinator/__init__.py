"""Persistent batch, scheduler, drafter, detokenizer and the coordinator that plans each step.
Its Ray wrapper is ``cluster.ray.coordinator_actor``."""
