"""From logits to tokens: the processors of a slot, counter-based random numbers, the sampler, and speculative rejection."""
