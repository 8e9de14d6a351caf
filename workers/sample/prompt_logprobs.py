"""Prompt logprobs: each prompt token's log probability given the tokens before it, as vLLM returns them
(``SamplingParams.prompt_logprobs``; lm-evaluation-harness scores every log-likelihood task with them).

Computed from the raw logits of the prompt chunk a step computes (the scheduler bounds the chunk, so a long
prompt never holds its whole logits at once), in slices of rows so that the float32 log-softmax adds little
beside them.
"""

from __future__ import annotations

import torch

from workers.wire import TokenLogprobs

SLICE_ROWS = 64


def prompt_logprobs(logits: torch.Tensor, targets: list[int], top: int, as_logits: bool = False
                    ) -> list[TokenLogprobs]:
    """``logits`` ``(positions, vocab)``: row ``i`` predicts ``targets[i]``. For each position: that token's
    logprob and rank (1 = the most likely; tokens as likely count ahead of it, as vLLM counts), and the ``top``
    most likely tokens with theirs. ``as_logits`` (``logprobs_mode`` raw_logits): the logits, not logprobs."""
    out: list[TokenLogprobs] = []
    target = torch.tensor(targets, dtype=torch.long, device=logits.device)
    for start in range(0, logits.shape[0], SLICE_ROWS):
        stop = min(start + SLICE_ROWS, logits.shape[0])
        logprobs = logits[start:stop].float()
        if not as_logits:
            logprobs = torch.log_softmax(logprobs, dim=-1)
        chosen = logprobs.gather(1, target[start:stop].unsqueeze(1))
        ranks = (logprobs >= chosen).sum(dim=-1).tolist()
        best = logprobs.topk(top, dim=-1) if top else None
        top_ids = best.indices.tolist() if best is not None else [[] for _ in range(stop - start)]
        top_values = best.values.tolist() if best is not None else [[] for _ in range(stop - start)]
        for i, (value, rank) in enumerate(zip(chosen.squeeze(1).tolist(), ranks)):
            out.append(TokenLogprobs(top_ids[i], top_values[i], targets[start + i], value, rank))
    return out
