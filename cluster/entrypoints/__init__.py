"""What users call: the job CLI and its line pipeline, vLLM's run-batch format, chat templating, LLM/AsyncLLM, and the Ray Data processor."""
