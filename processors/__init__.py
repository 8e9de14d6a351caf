"""The logits-processor programming model of vLLM V1, with no Ray and no engine.

A processor written for vLLM runs here after changing only its imports:
``from vllm.v1.sample.logits_processor import ...`` and
``from vllm import SamplingParams`` become ``from processors import ...``.
"""

from processors.adapter import AdapterLogitsProcessor, RequestLogitsProcessor
from processors.builtins.vllm_builtins import (
    BUILTIN_LOGITS_PROCESSORS,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from processors.config import EngineConfig, ModelConfig, ReasoningConfig, SchedulerConfig, SpeculativeConfig
from processors.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
    RemovedRequest,
)
from processors.loading import (
    ENTRY_POINT_GROUP,
    LOGITSPROCS_GROUP,
    STR_POOLING_REJECTS_LOGITSPROCS,
    LogitsProcessorLoadError,
    ProcessorSpec,
    build_logitsprocs,
    validate_logits_processors_parameters,
)
from processors.lora_request import LoRARequest
from processors.sampling_params import SamplingParams, SamplingType
from processors.state import BatchUpdateBuilder, LogitsProcessors, process_dict_updates
from processors.structured_outputs import StructuredOutputsParams

__all__ = [
    "AdapterLogitsProcessor",
    "AddedRequest",
    "BUILTIN_LOGITS_PROCESSORS",
    "BatchUpdate",
    "BatchUpdateBuilder",
    "ENTRY_POINT_GROUP",
    "EngineConfig",
    "LOGITSPROCS_GROUP",
    "STR_POOLING_REJECTS_LOGITSPROCS",
    "VllmConfig",
    "LoRARequest",
    "LogitBiasLogitsProcessor",
    "LogitsProcessor",
    "LogitsProcessorLoadError",
    "LogitsProcessors",
    "MinPLogitsProcessor",
    "MinTokensLogitsProcessor",
    "ModelConfig",
    "MoveDirectionality",
    "MovedRequest",
    "ProcessorSpec",
    "ReasoningConfig",
    "RemovedRequest",
    "RequestLogitsProcessor",
    "SamplingParams",
    "SamplingType",
    "SchedulerConfig",
    "SpeculativeConfig",
    "StructuredOutputsParams",
    "build_logitsprocs",
    "process_dict_updates",
    "validate_logits_processors_parameters",
]

VllmConfig = EngineConfig  # what vLLM processors annotate their config argument with
