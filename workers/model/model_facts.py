"""What a run knows of its model before any weights load, read once where the run starts.

The entry point (``cluster.config.resolve``) builds this and hands it down with the configuration:
the engine, the coordinator and every worker read the model's folder, its Hugging Face config and
its limits from here, so none of them reloads ``config.json`` or converts a GGUF again (vLLM builds
one ``VllmConfig`` the same way).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from workers.model.model_support import resolved_max_model_len


@dataclass(frozen=True)
class ModelFacts:
    path: str  # the folder (or hub id) the weights load from: a tiny model built, a GGUF converted
    tokenizer: str  # where the tokenizer loads from: model.tokenizer, else ``path``
    trust_remote_code: bool
    vocab_size: int
    max_model_len: int  # model.max_model_len checked against the model's limit, or that limit
    generation_eos: int | list[int] | None  # generation_config.json's eos_token_id, when it has one
    # The model's transformers ``PretrainedConfig``, read through ``hf_config``. It crosses a process
    # boundary as its pickle and is unpickled where it is first read: unpickling a config class imports
    # transformers' model-loading code (about 1.7 s of CPU a process), which a coordinator never needs.
    _config: Any = field(repr=False, compare=False)

    @property
    def hf_config(self) -> Any:
        if isinstance(self._config, bytes):
            object.__setattr__(self, "_config", pickle.loads(self._config))
        return self._config

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        config = state["_config"]
        # A trust_remote_code config's class lives in a module only its own loader can import: it goes as it is.
        if not isinstance(config, bytes) and type(config).__module__.startswith("transformers."):
            state["_config"] = pickle.dumps(config)
        return state

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
        return cls(path=path, tokenizer=tokenizer or path, trust_remote_code=trust_remote_code,
                   vocab_size=hf_config.vocab_size, max_model_len=resolved_max_model_len(hf_config, max_model_len),
                   generation_eos=generation_eos, _config=hf_config)
