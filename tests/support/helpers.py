"""Shared test helpers: a reference model of the persistent batch and per-row references."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import torch
import yaml

from processors import BatchUpdate, EngineConfig, MoveDirectionality, SamplingParams

VOCAB = 32
ROOT = Path(__file__).resolve().parents[2]


def pythonpath(*first: str | Path) -> str:
    """``PYTHONPATH`` with ``first`` ahead of the suite's own entries (its start-up module, which conftest
    puts there): a child process or Ray worker given it finds both. No empty entry (that would be the
    current directory)."""
    return os.pathsep.join(str(p) for p in (*first, *os.environ.get("PYTHONPATH", "").split(os.pathsep)) if str(p))


def tiny_job_config() -> dict:
    """``configs/default.yaml`` on the tiny test model (the default before the real one), for tests
    of the job machinery, which does not depend on the model: the tiny one is fast."""
    config = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    config["model"] = {"tiny": "default", "dtype": "float32", "max_model_len": 256}
    config["cache"]["kv_cache_memory"] = "16MiB"
    config["defaults"] = {"max_tokens": 32, "temperature": 0.8, "top_p": 0.95}
    return config


def run_job_main(capsys, *args: str) -> subprocess.CompletedProcess:
    """The job's ``main`` (``raysample`` from its argument list) in the test's process, for runs whose point
    is what the job writes, not how its process starts or ends: no torch import and engine start of a
    process of its own. The console script and ``python -m`` run as processes where exits matter."""
    from cluster.entrypoints.job import main

    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["raysample", *args], code, out, err)


def ctrl_c_reaches_it() -> None:
    """``preexec_fn`` of a child a test sends SIGINT: a suite started in the background (``cmd &`` in a
    script) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler in the child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def engine_config(max_num_seqs: int = 64) -> EngineConfig:
    return EngineConfig.simple(max_num_seqs)


def apply_update_to_rows(rows: list, update: BatchUpdate | None, payload_of_added) -> list:
    """Replay a BatchUpdate on a plain list (``None`` = empty row), the way the seed describes it."""
    if update is None:
        return rows
    rows = list(rows)
    for index in update.removed:
        rows[index] = None
    for index, params, prompt, output in update.added:
        while len(rows) <= index:
            rows.append(None)
        rows[index] = payload_of_added(params, prompt, output)
    for a, b, direction in update.moved:
        while len(rows) <= max(a, b):
            rows.append(None)
        if direction == MoveDirectionality.SWAP:
            rows[a], rows[b] = rows[b], rows[a]
        else:
            rows[b], rows[a] = rows[a], None
    del rows[update.batch_size :]
    return rows


def reference_min_p(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    if not params.min_p:
        return row
    probs = torch.softmax(row, dim=-1)
    return row.masked_fill(probs < probs.max() * params.min_p, float("-inf"))


def reference_logit_bias(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    row = row.clone()
    for tok, bias in (params.logit_bias or {}).items():
        row[tok] += bias
    return row


def reference_min_tokens(row: torch.Tensor, params: SamplingParams, output: list[int]) -> torch.Tensor:
    row = row.clone()
    if len(output) < params.min_tokens:
        for tok in params.all_stop_token_ids:
            row[tok] = float("-inf")
    return row


def reference_allowed(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    if not params.allowed_token_ids:
        return row
    out = torch.full_like(row, float("-inf"))
    ids = torch.tensor(params.allowed_token_ids)
    out[ids] = row[ids]
    return out


def reference_bad_words(row: torch.Tensor, params: SamplingParams, output: list[int]) -> torch.Tensor:
    row = row.clone()
    for seq in params.bad_words_token_ids or []:
        prefix = seq[:-1]
        if len(prefix) <= len(output) and (not prefix or output[-len(prefix):] == prefix):
            row[seq[-1]] = float("-inf")
    return row


def reference_penalties(row: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Dense, vLLM-style: masks and bin counts over the whole vocabulary."""
    row = row.clone()
    vocab = row.shape[0]
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab).float()
    seen = counts > 0
    seen_any = seen | (torch.bincount(torch.tensor(prompt, dtype=torch.long), minlength=vocab) > 0)
    rep = params.repetition_penalty
    penalised = torch.where(row > 0, row / rep, row * rep)
    row = torch.where(seen_any, penalised, row) if rep != 1.0 else row
    row = row - params.frequency_penalty * counts * seen
    row = row - params.presence_penalty * seen.float()
    return row


def reference_temperature(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return row if params.temperature < 1e-5 else row / params.temperature


def reference_top_k_top_p(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Full sort of the vocabulary (what the fast path avoids)."""
    row = row.clone()
    if params.top_k > 0:
        kth = torch.sort(row, descending=True).values[min(params.top_k, row.shape[0]) - 1]
        row[row < kth] = float("-inf")
    if params.top_p < 1.0:
        values = torch.sort(row, descending=True).values
        probs = torch.exp(values - torch.logsumexp(row, dim=0))
        mass_above = probs.cumsum(0) - probs
        kept = int((mass_above < params.top_p).sum())
        row[row < values[kept - 1]] = float("-inf")
    return row


class FaultAfterFirstResults:
    """A job backend that calls ``fault()`` once, as soon as its first results are polled (mid-job)."""

    def __init__(self, backend, fault) -> None:
        self.backend, self.fault, self.done = backend, fault, False

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def poll(self, ids, timeout_s, finished_only=False):
        outs = self.backend.poll(ids, timeout_s, finished_only)
        if outs and not self.done:
            self.done = True
            self.fault()
        return outs


def chisquare_pvalue(observed, expected) -> float:
    """Pearson's chi-square test of counts against expected counts (as ``scipy.stats.chisquare``): the p-value,
    the chi-square distribution's upper tail at the statistic, ``Q(df / 2, statistic / 2)``."""
    observed = torch.as_tensor(observed, dtype=torch.float64).flatten()
    expected = torch.as_tensor(expected, dtype=torch.float64).flatten()
    statistic = ((observed - expected) ** 2 / expected).sum()
    half_df = torch.tensor((observed.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(half_df, statistic / 2))
