"""A request's way in: validation, prompt limits, grammar checks in a bounded child process, and quarantine of suspects."""
