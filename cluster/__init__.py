"""Configuration, Ray start-up and placement, the client handle, the job entrypoint."""
