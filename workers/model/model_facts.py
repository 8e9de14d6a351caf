"""What a run knows of its model before any weights load, read once where the run starts.

The entry point (``cluster.config.resolve``) builds this and hands it down with the configuration:
the engine, the coordinator and every worker read the model's folder, its Hugging Face config and
its limits from here, so none of them reloads ``config.json`` or converts a GGUF again (vLLM builds
one ``VllmConfig`` the same way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.model.model_support import resolved_max_model_len


@dataclass(frozen=True)
class ModelFacts:
    path: str  # the folder (or hub id) the weights load from: a tiny model built, a GGUF converted
    tokenizer: str  # where the tokenizer loads from: model.tokenizer, else ``path``
    trust_remote_code: bool
    hf_config: Any  # the model's transformers ``PretrainedConfig``
    max_model_len: int  # model.max_model_len checked against the model's limit, or that limit
    generation_eos: int | list[int] | None  # generation_config.json's eos_token_id, when it has one

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @classmethod
    def read(cls, path: str, tokenizer: str | None, max_model_len: int | None,
             trust_remote_code: bool = False) -> ModelFacts:
        """Raises ``ValueError`` for a max_model_len past the model's limit (vLLM refuses it too)."""
        from transformers import AutoConfig, GenerationConfig

        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        try:
            generation_eos = GenerationConfig.from_pretrained(path).to_dict().get("eos_token_id")
        except OSError:
            generation_eos = None
        return cls(path=path, tokenizer=tokenizer or path, trust_remote_code=trust_remote_code, hf_config=hf_config,
                   max_model_len=resolved_max_model_len(hf_config, max_model_len), generation_eos=generation_eos)
