"""Speculative decoding's drafts: the n-gram drafter, its batched form, and the policy that sizes drafts per row."""
