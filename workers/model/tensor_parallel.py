"""A worker as a tensor-parallel group: one process per rank, each holding its shard of the model.

transformers shards the model with its own tensor-parallel plan (``DistributedConfig(tp_size=N)``)
over a ``torch.distributed`` group: gloo on CPU, NCCL on CUDA. Attention heads are split across the
ranks, so each rank's paged KV cache holds ``kv_heads / N`` heads, and every forward is run by all
ranks together (their all-reduces meet).

The group's lead rank is the worker: it holds the processor replicas and samples. The other ranks
(followers) only run forwards: the lead sends each forward's rows, and each KV block copy, to every
follower before running its own, in one order, so the ranks' collectives always pair up. Every rank's
logits are the whole vocabulary (transformers gathers the LM head's output); the followers drop theirs.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import Any, Protocol

import torch

from workers.row_work import RowWork
from workers.wire import TensorRank


class TensorGroupLost(RuntimeError):
    """A rank of this worker's group died or stopped answering: the group is lost as one worker."""


def check_divisible(config: Any, size: int) -> None:
    """Refuse, before any weight loads, a tensor-parallel size that does not split the model evenly.

    transformers shards q/k/v by output rows: a size that does not divide the heads would cut a head
    in two (vLLM refuses the same sizes, in the same words for the attention heads)."""
    if size == 1:
        return
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % size:
        raise ValueError(f"Total number of attention heads ({heads}) must be divisible by tensor parallel size "
                         f"({size}).")
    if kv_heads % size:
        raise ValueError(f"Total number of key/value heads ({kv_heads}) must be divisible by tensor parallel size "
                         f"({size}); raysample does not replicate KV heads across ranks.")
    for name in ("intermediate_size", "vocab_size"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value % size:
            raise ValueError(f"{name} ({value}) must be divisible by tensor parallel size ({size}).")


def valid_sizes(config: Any, largest: int = 64) -> list[int]:
    """The tensor-parallel sizes this model can be split into, up to ``largest``."""
    sizes = []
    for size in range(1, largest + 1):
        try:
            check_divisible(config, size)
        except ValueError:
            continue
        sizes.append(size)
    return sizes


def join_group(rank: TensorRank, device: torch.device, timeout_s: float) -> None:
    """Join this rank's process group (blocks until every rank has joined).

    ``timeout_s`` bounds each collective: a rank that stops answering fails its group's forward
    instead of hanging it forever."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group")
    # Each rank sees its own GPU as device 0 (Ray sets CUDA_VISIBLE_DEVICES per actor); transformers
    # binds the device from LOCAL_RANK.
    os.environ["LOCAL_RANK"] = "0"
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=rank.address, rank=rank.rank, world_size=rank.size,
                            timeout=timedelta(seconds=timeout_s))


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def in_a_group() -> bool:
    """Whether this process is a rank of a tensor-parallel group (collectives wait for the others)."""
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_world_size() > 1


def agree_all(value: bool) -> bool:
    """Whether ``value`` holds on every rank of the group (True when there is no group)."""
    return bool(smallest_over_ranks(int(value)))


def smallest_over_ranks(value: int) -> int:
    """The smallest ``value`` over the group's ranks (KV blocks: every rank must hold the same count)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.long)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def shard_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters and buffers this rank holds (its local shards)."""
    total = 0
    for tensor in (*model.parameters(), *model.buffers()):
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


class Followers(Protocol):
    """How the lead reaches its followers (Ray actor calls, from the cluster layer)."""

    def send_forward(self, rows: list[RowWork]) -> None: ...

    def send_copy_blocks(self, sources: list[int], targets: list[int]) -> None: ...

    def wait(self) -> None:
        """Raise ``TensorGroupLost`` unless every follower finished what was sent."""


class LeadRunner:
    """The lead rank's model runner: each forward and block copy runs on every rank of the group.

    Forwards run on the compute thread (``workers.step.compute_thread``); should one come from another
    thread, a lock keeps the order the followers receive them the order the lead runs them."""

    def __init__(self, runner: Any, followers: Followers) -> None:
        self.runner = runner
        self.followers = followers
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:  # the runner's attributes (num_blocks, block_size, model ...)
        return getattr(self.runner, name)

    def forward(self, rows: list[RowWork]) -> torch.Tensor:
        if not rows:
            return self.runner.forward(rows)
        with self._lock:
            self.followers.send_forward(rows)
            try:
                logits = self.runner.forward(rows)
            except Exception:
                self.followers.wait()  # a follower's death or hang is the cause: that is what is raised
                raise
            self.followers.wait()
            return logits

    def copy_blocks(self, sources: list[int], targets: list[int]) -> None:
        with self._lock:
            self.followers.send_copy_blocks(sources, targets)
            self.runner.copy_blocks(sources, targets)
            self.followers.wait()
