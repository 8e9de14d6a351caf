"""Persistent batch, scheduler, drafter, detokenizer, the coordinator and its Ray wrapper."""
