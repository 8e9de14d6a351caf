"""vLLM's ``LoRARequest``: which LoRA adapter a request runs with (``generate(..., lora_request=...)``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """``lora_name``: how outputs and logs name it; ``lora_int_id``: its identity (positive, unique per
    adapter: two requests with the same id share its weights and prefix cache); ``lora_path``: a PEFT
    adapter directory (``adapter_config.json`` and ``adapter_model.safetensors``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must name a PEFT adapter directory, got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
