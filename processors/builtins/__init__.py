"""SamplingParams fields and vLLM's builtin processors implemented with the programming model, plus grammar and thinking-budget processors."""
