"""Which rows run next: the scheduler, the slot table, the persistent batch and the step plan's arrays."""
