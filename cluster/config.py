"""The job configuration: one pydantic schema, validated once on load, never mutated.

A YAML file (or a dict) maps onto ``RaysampleConfig``; unknown keys and wrong
types are errors naming the key path and the expected type.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from processors import EngineConfig, ModelConfig, ProcessorSpec, SchedulerConfig, SpeculativeConfig


_BYTE_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
               "gb": 10**9, "tb": 10**12}


def parse_bytes(value: Any) -> Any:
    """``"2GiB"``, ``"512MiB"``, ``"1.5GB"`` to bytes; other values pass through for pydantic to check."""
    if not isinstance(value, str):
        return value
    text = value.strip().lower().replace(" ", "")
    number = text.rstrip("kmgtib")
    unit = text[len(number):]
    if unit not in _BYTE_UNITS:
        raise ValueError(f"expected bytes or a size like '2GiB', got {value!r}")
    try:
        return int(float(number) * _BYTE_UNITS[unit])
    except ValueError:
        raise ValueError(f"expected bytes or a size like '2GiB', got {value!r}") from None


# A size in bytes, given as a number or as "2GiB", "512MiB", "1.5GB".
Bytes = Annotated[int, BeforeValidator(parse_bytes)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SimulateSection(_Section):
    """A worker that loads no weights and sleeps for a modelled GPU step time (``workers.doubles.simulated_runner``):
    ``preset`` (a roofline, e.g. ``llama-8b-h100``) or ``fixed_ms`` + ``per_token_ms``. The model source
    (usually ``tiny``) gives the tokenizer and vocabulary; logits are a hash of each row's last token."""

    preset: str | None = None
    fixed_ms: float | None = Field(default=None, ge=0.0)
    per_token_ms: float | None = Field(default=None, ge=0.0)
    num_blocks: int | None = Field(default=None, ge=1)  # KV blocks a worker claims (none are allocated)
    # With model.tensor_parallel_size > 1, each rank computes 1/N of the step plus two all-reduces a
    # layer: this latency each (NCCL on NVLink, small messages) and the hidden vectors at this bus
    # bandwidth (NCCL's all-reduce bus bandwidth on 8 H100 SXM, large messages: about 360 GB/s).
    allreduce_latency_us: float = Field(default=10.0, ge=0.0)
    allreduce_gb_per_s: float = Field(default=360.0, gt=0.0)

    @model_validator(mode="after")
    def _one_timing(self) -> SimulateSection:
        from workers.doubles.simulated_runner import PRESETS

        explicit = self.fixed_ms is not None or self.per_token_ms is not None
        if (self.preset is None) == (not explicit):
            raise ValueError("model.simulate needs preset, or fixed_ms and per_token_ms, not both")
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"unknown simulate preset {self.preset!r}; presets: {', '.join(sorted(PRESETS))}")
        return self

    def compute_model(self, tensor_parallel_size: int = 1) -> Any:
        """The modelled step of one worker, or of one rank of a tensor-parallel group."""
        from workers.doubles.simulated_runner import PRESETS, ComputeModel

        if self.preset is not None:
            whole = PRESETS[self.preset]
        else:
            whole = ComputeModel((self.fixed_ms or 0.0) / 1e3, (self.per_token_ms or 0.0) / 1e3)
        return whole.split(tensor_parallel_size, self.allreduce_latency_us / 1e6, self.allreduce_gb_per_s * 1e9)


class ModelSection(_Section):
    """Exactly one source: ``path`` (a transformers directory, a hub id, or a ``.gguf`` file;
    a directory plus ``gguf_file`` names a GGUF inside it), ``preset`` (a GGUF inside an
    installed wheel, ``workers.model.model_source.PRESETS``) or ``tiny`` (a locally built test model).
    A GGUF is converted once into a cached transformers directory (``RAYSAMPLE_CACHE_DIR``)."""

    path: str | None = None
    gguf_file: str | None = None
    preset: str | None = None
    tiny: str | None = None
    tokenizer: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int | None = Field(default=None, ge=2)
    trust_remote_code: bool = False
    max_logprobs: int = Field(default=20, ge=-1)  # as vLLM: the most logprobs a request may ask; -1 = vocabulary
    # vLLM's: what logprobs (sampled and prompt) hold. raw_logprobs: log-softmax of the model's logits;
    # raw_logits: the logits themselves. The processed_* modes are refused (see the validator).
    logprobs_mode: Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"] = "raw_logprobs"
    # CPU float32: reorder linear weights once for oneDNN (2-3x faster matmuls here).
    cpu_weight_prepack: bool = True
    # Paged attention. "native": a C++ CPU kernel (workers/cpu/native, built by make setup or on first
    # use) for decode and draft-verification rows, reading only each row's valid keys; "flex": torch's
    # FlexAttention over the pool's blocks for every step shape (decode, prompt chunks, drafts), no copy
    # of K/V (compiled on CUDA; torch's slow dense reference elsewhere); "torch": batched torch products
    # over whole KV blocks and SDPA over gathered prompt chunks (any device). "auto": native on CPU with
    # float32 or bfloat16 where it builds (a warning names the reason where not), flex on CUDA, else torch.
    decode_attention: Literal["auto", "native", "flex", "torch"] = "auto"
    # vLLM's names. Decode steps run as forwards of fixed shape (rows padded to a capture size),
    # captured once per size as CUDA graphs on a GPU. Unset: graphs on CUDA, the variable-shape
    # forward on CPU; true: eager everywhere; false on CPU: the fixed-shape forward under
    # torch.compile(fullgraph=True), the proof that it is graph-safe (workers/model/static_decode.py).
    enforce_eager: bool | None = None
    # CPU: a row's bits never depend on its batch or its prompt's chunking, by construction (docs/reliability.md):
    # every linear called with exactly cpu_row_tile rows (padded or split), every query attended in the native
    # kernel. false: the kernels as they are (faster where prompts are long; bits may move with the batch).
    batch_invariant: bool = True
    cpu_row_tile: int = Field(default=64, ge=1, le=4096)
    # A call of fewer rows (or a long call's last part) may take a smaller size, a multiple of this one below
    # cpu_row_tile (8, 16, ..., 56), where the CPU's kernel gives every row the same bits at that size (checked
    # once per shape on each host; a size that differs is never used); a single CPU worker's steps are sized to
    # multiples of it. At or above cpu_row_tile: every call takes the tile.
    cpu_smallest_row_tile: int = Field(default=8, ge=1, le=4096)
    cudagraph_capture_sizes: list[Annotated[int, Field(ge=1)]] | None = None  # default: 1, 2, 4, 8, 16, 24, ...
    # Ranks per worker (vLLM's tensor_parallel_size): each worker is a group of this many Ray actors,
    # one per GPU (or CPU share), each holding its shard of the model and of the attention heads;
    # the cluster.*_per_worker resources are per rank. Needs Ray (one process per rank).
    tensor_parallel_size: int = Field(default=1, ge=1)
    # Benchmarks and capacity planning: no weights, a modelled step time (see SimulateSection).
    simulate: SimulateSection | None = None
    # vLLM's --served-model-name: the names a run-batch line's "model" may give (one name or a list;
    # default: the model as configured); responses carry the first. Another name gets vLLM's 404 record.
    served_model_name: list[str] | None = None

    @field_validator("logprobs_mode")
    @classmethod
    def _raw_modes_only(cls, value: str) -> str:
        if value.startswith("processed_"):
            raise ValueError(f"{value!r} is not supported: sampled logprobs are taken from the model's logits before "
                             "any processor, penalty or temperature (raw_logprobs, raw_logits)")
        return value

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if sum(x is not None for x in (self.path, self.preset, self.tiny)) != 1:
            raise ValueError("give exactly one of model.path (a directory, hub id or .gguf file), model.preset "
                             "(e.g. smollm2-135m-instruct) or model.tiny (a test model)")
        if self.gguf_file is not None and self.path is None:
            raise ValueError("model.gguf_file names a file inside model.path: give model.path too")
        return self

    def display_name(self) -> str:
        return self.path or self.preset or f"tiny-{self.tiny}"

    def served_names(self) -> list[str]:
        """The names a run-batch line's ``model`` may give (vLLM's ``--served-model-name``; default: the
        model as configured); responses carry the first."""
        return list(self.served_model_name or [self.display_name()])

    def gguf(self) -> Path | None:
        """The GGUF file this source names, if it names one."""
        from workers.model.model_source import preset_gguf

        if self.preset is not None:
            return preset_gguf(self.preset)
        if self.path is None:
            return None
        if self.gguf_file is not None:
            folder = Path(self.path).expanduser()
            if not folder.is_dir():
                raise ValueError(f"model.gguf_file needs model.path to be a local directory, not {self.path!r} "
                                 "(download the file and name it in model.path)")
            return folder / self.gguf_file
        return Path(self.path).expanduser() if self.path.endswith(".gguf") else None

    def resolve_path(self) -> str:
        """Directory or hub id to load from (builds the tiny model, or converts a GGUF, on first use)."""
        if self.tiny is not None:
            from workers.model.tiny import ensure_tiny_model

            return str(ensure_tiny_model(self.tiny))
        gguf = self.gguf()
        if gguf is not None:
            from workers.model.model_source import gguf_to_transformers

            return str(gguf_to_transformers(gguf, self.dtype))
        return str(self.path)


class ClusterSection(_Section):
    address: str = "local"  # local | auto | ray://host:port | host:port
    num_workers: int = Field(default=1, ge=1)  # per engine
    # Data-parallel engines (vLLM's data_parallel_size): each a coordinator with its own workers and
    # placement group; requests go to the one with the least outstanding work.
    num_engines: int = Field(default=1, ge=1)
    gpus_per_worker: float = Field(default=0.0, ge=0.0)
    cpus_per_worker: float = Field(default=1.0, gt=0.0)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    # The engine's name on the cluster (Engine.connect(name)); unset: a new unique name per engine,
    # so several jobs share a cluster.
    coordinator_name: str | None = None
    namespace: str = "raysample"
    call_timeout_s: float = Field(default=120.0, gt=0.0)
    # How long workers (and replacements) may take to load the model and come up; a step's
    # call_timeout_s is far too short for a large checkpoint. 600 s, as vLLM's VLLM_ENGINE_READY_TIMEOUT_S.
    startup_timeout_s: float = Field(default=600.0, gt=0.0)
    # Dead or hung workers are replaced by new actors on their placement bundles, this many times
    # over the engine's life; past that (or when a replacement cannot start) the survivors go on.
    max_worker_replacements: int = Field(default=4, ge=0)
    # Bytes of Ray's ``memory`` resource each worker actor asks for, so Ray never packs more workers on a
    # node than fit. Unset: for CPU workers, their weights + KV budget + a runtime allowance
    # (cluster.memory, computed at start); GPU workers ask for none.
    memory_per_worker: Bytes | None = Field(default=None, gt=0)
    # Fan the plan out through a Ray compiled graph (shared-memory channels) instead of actor calls.
    # Its channels busy-wait: the coordinator and every worker keep a core spinning between steps.
    # "auto": on for GPU workers (compute is on the device, the spin buys lower latency); off for
    # CPU workers, whose cores the spinning would take from the model (bench/step_overhead.py).
    compiled_graph: bool | Literal["auto"] = "auto"

    def use_compiled_graph(self) -> bool:
        if self.compiled_graph == "auto":
            return self.gpus_per_worker > 0
        return self.compiled_graph


class SchedulerSection(_Section):
    max_num_seqs: int = Field(default=64, ge=1)
    # Tokens computed per step over all rows (decode, prefill chunks, drafts): long prompts are
    # split across steps so decoding rows are never starved.
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    # Rows (running requests) per worker; default: max_num_seqs (one worker may hold every request).
    max_num_seqs_per_worker: int | None = Field(default=None, ge=1)
    seed: int = 0
    consistency_check_every: int = Field(default=0, ge=0)
    # The pipelined step (vLLM's name): each worker starts its next forward as soon as it has
    # sampled, before the next plan arrives, so planning and applying the plan overlap the
    # compute. False: every step waits for its plan (for comparison and debugging). None (the
    # default): on where the forward runs off the host (GPU workers without CUDA graphs, simulated
    # ones), off on CPU workers, whose forward would take the very cores the host work needs, and off
    # where steps replay CUDA graphs, where it measured slower (bench/RESULTS.md).
    # Outputs are the same either way on CPU, bit for bit; on a GPU, whose kernels may round
    # differently for another batch shape, up to that rounding (bench/RESULTS.md, GPU).
    async_scheduling: bool | None = None

    def slots_per_worker(self) -> int:
        return self.max_num_seqs_per_worker or self.max_num_seqs


class CacheSection(_Section):
    """Paged KV cache: blocks of ``block_size`` tokens from a memory budget per worker.

    ``kv_cache_memory`` (bytes, or a string such as ``"2GiB"``) fixes the budget; without it a GPU
    worker takes ``gpu_memory_utilization`` of its device minus what is in use after loading the
    model, and a CPU worker enough for every row at ``max_model_len``.
    """

    # Tokens per block; default 16 (prefix-cache hits land on block boundaries), 64 on CPU when decode
    # attention runs in torch (model.decode_attention: torch), which reads K/V block by block and pays
    # for many tiny products more than for the padding of larger blocks.
    block_size: int | None = Field(default=None, ge=1, le=1024)
    kv_cache_memory: Bytes | None = Field(default=None, gt=0)
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    enable_prefix_caching: bool = True
    # How long a process waits for another that holds a lock of the host's raysample cache (building a
    # kernel, probing a layer) before it fails with a line naming the holder; it says once that it waits.
    lock_timeout_s: float = Field(default=900.0, gt=0.0)


class ProcessorItem(_Section):
    """A processor class with constructor kwargs (given after ``config, device, is_pin_memory``).

    ``request_level: true`` names a vLLM-V0 style request-level callable instead
    (e.g. ``logits_processor_zoo.vllm:GenLengthLogitsProcessor``); it runs through
    ``AdapterLogitsProcessor`` for requests whose ``extra_args`` contain ``enable_with``.
    """

    class_: Union[str, type] = Field(alias="class")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    request_level: bool = False
    enable_with: str | None = None
    argmax_invariant: bool = False

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="after")
    def _request_level_needs_switch(self) -> ProcessorItem:
        if self.request_level and not self.enable_with:
            raise ValueError("a request_level processor needs enable_with: the extra_args key that turns it on")
        return self

    def spec(self) -> ProcessorSpec:
        if not self.request_level:
            return ProcessorSpec(self.class_, dict(self.kwargs))
        return ProcessorSpec(
            "processors.builtins.request_level:RequestLevelAdapter",
            {"target": self.class_, "enable_with": self.enable_with, "kwargs": dict(self.kwargs),
             "argmax_invariant": self.argmax_invariant},
        )


class SpeculativeSection(_Section):
    method: Literal["ngram"] = "ngram"
    num_speculative_tokens: int = Field(default=3, ge=1, le=16)
    prompt_lookup_min: int = Field(default=1, ge=1)
    prompt_lookup_max: int = Field(default=3, ge=1)
    # adaptive: per step, verify only the drafts whose expected gain pays for their compute, from
    # each row's acceptance history and the measured step cost (coordinator/spec/draft_policy.py);
    # fixed: every draft the n-gram lookup finds, up to num_speculative_tokens, as vLLM does.
    draft_policy: Literal["adaptive", "fixed"] = "adaptive"

    @model_validator(mode="after")
    def _ordered(self) -> SpeculativeSection:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative.prompt_lookup_min must be <= prompt_lookup_max")
        return self


class ReasoningSection(_Section):
    """Thinking markers. As text they match however the tokenizer splits them after other text
    (``" <think>"`` and ``"<think>"`` are different ids in most BPE vocabularies); as ids they
    match exactly, and ``end_token_ids`` is also what a spent budget forces."""

    start: str = "<think>"
    end: str = "</think>"
    start_token_ids: list[int] | None = Field(default=None, min_length=1)
    end_token_ids: list[int] | None = Field(default=None, min_length=1)


class StructuredOutputsSection(_Section):
    # Compiled grammars kept per process (coordinator and each worker), least recently used evicted.
    grammar_cache_size: int = Field(default=256, ge=1)
    # A constraint is first compiled in a child process that is killed past either bound: a schema
    # that would take longer or more memory fails its own request and holds no other.
    compile_timeout_s: float = Field(default=10.0, gt=0.0)
    compile_max_memory: Bytes = Field(default=2 << 30, gt=0)  # bytes, or "2GiB"


class LoraSection(_Section):
    """LoRA adapters per request (vLLM's enable_lora, max_loras, max_lora_rank, max_cpu_loras). ``modules``:
    adapters a JSONL or run-batch line selects by its ``model`` name (vLLM's ``--lora-modules name=path``)."""

    enabled: bool = False
    max_loras: int = Field(default=1, ge=1)  # adapters on a worker's device at once (and in one step)
    max_lora_rank: int = Field(default=16, ge=1)
    max_cpu_loras: int | None = Field(default=None, ge=1)  # kept loaded on the host; default: max_loras
    modules: dict[str, str] = Field(default_factory=dict)
    # A directory whose subdirectories are adapters a line or row may name (Ray Data LLM's on-demand loading).
    dynamic_lora_loading_path: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _modules_enable(cls, data: Any) -> Any:
        """Naming adapters serves them (as vLLM's --lora-modules does)."""
        if isinstance(data, dict) and (data.get("modules") or data.get("dynamic_lora_loading_path")):
            return {**data, "enabled": True}
        return data


class InputSection(_Section):
    """Bounds on what one input line (a ``generate`` or ``run-batch`` line) may ask for; a line past
    one gets an error record of its own and the job goes on."""

    max_json_depth: int = Field(default=64, ge=2, le=500)  # nesting of objects and arrays in a line
    max_requests_per_line: int = Field(default=1024, ge=1)  # a run-batch line's prompts x n
    # Admission order (coordinator/intake/prefix_order.py): requests that share a prompt prefix enter the
    # engine side by side, so each shared prefix is computed once while its group runs. A job reads
    # this far ahead (lines, and bytes of them) to find them; LLM.generate/chat order each call's list.
    # False: input order.
    group_by_prefix: bool = True
    read_ahead_lines: int = Field(default=4096, ge=1)
    read_ahead_bytes: Bytes = Field(default=64 * 2**20, ge=1)


class RaysampleConfig(_Section):
    model: ModelSection
    cluster: ClusterSection = ClusterSection()
    scheduler: SchedulerSection = SchedulerSection()
    cache: CacheSection = CacheSection()
    structured_outputs: StructuredOutputsSection = StructuredOutputsSection()
    input: InputSection = InputSection()
    lora: LoraSection = LoraSection()
    processors: list[Union[str, type, ProcessorItem]] = Field(default_factory=list)
    # Load processors installed as plugins (entry-point groups vllm.logits_processors and
    # raysample.logits_processors) on every engine, as vLLM does.
    processors_from_entry_points: bool = True
    speculative: SpeculativeSection | None = None
    reasoning: ReasoningSection | None = None
    defaults: dict[str, Any] = Field(default_factory=dict)
    # What ``resolve`` read of the model (``workers.model.model_facts.ModelFacts``); kept by copies and
    # pickling, never by dumps: a config written out is the user's, a resolved one is a run's.
    _facts: Any = PrivateAttr(default=None)

    @property
    def facts(self) -> Any:
        """The model's folder, Hugging Face config and limits, read once where the run started."""
        if self._facts is None:
            raise ConfigError("this configuration has not been resolved: an entry point calls cluster.config.resolve "
                              "once and hands the result down")
        return self._facts

    @property
    def resolved(self) -> bool:
        return self._facts is not None

    @model_validator(mode="after")
    def _pipelined_step_without_drafts(self) -> RaysampleConfig:
        if self.scheduler.async_scheduling and self.speculative is not None:
            raise ValueError("scheduler.async_scheduling: true cannot be used with speculative decoding: drafts come "
                             "in each step's plan, so a worker cannot start the step before it arrives; leave "
                             "async_scheduling unset (synchronous with speculative decoding) or set it to false")
        return self

    @field_validator("defaults")
    @classmethod
    def _defaults_are_sampling_params(cls, value: dict[str, Any]) -> dict[str, Any]:
        from processors import SamplingParams

        SamplingParams.from_dict(value)  # raises ValueError naming the field
        return value

    def custom_processors(self) -> list[str | type | ProcessorSpec]:
        return [p.spec() if isinstance(p, ProcessorItem) else p for p in self.processors]

    def engine_config(self, model_path: str | None = None, vocab_size: int = 0, max_model_len: int = 0) -> EngineConfig:
        """What processor constructors receive (vLLM's ``VllmConfig`` attributes they read)."""
        spec = self.speculative
        return EngineConfig(
            scheduler_config=SchedulerConfig(max_num_seqs=self.scheduler.max_num_seqs),
            model_config=ModelConfig(vocab_size, max_model_len, self.model.tokenizer or model_path,
                                     logprobs_mode=self.model.logprobs_mode),
            speculative_config=None
            if spec is None
            else SpeculativeConfig(spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max),
        )


class ConfigError(ValueError):
    """A configuration could not be loaded; the message names every offending key."""


def _format_errors(exc: ValidationError) -> str:
    lines = []
    errors = exc.errors()
    for err in errors:
        # A processor item is "string or mapping": for a mapping, the string branch is noise.
        if err["type"] == "string_type" and err["loc"][-1:] == ("str",) and len(errors) > 1:
            continue
        path = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-") and p != "ProcessorItem")
        path = path or "<root>"
        got = "" if err["type"] in ("missing", "extra_forbidden") else f" (got {err.get('input')!r})"
        lines.append(f"  {path}: {err['msg']}{got}")
    return "invalid raysample config:\n" + "\n".join(lines)


def load_config(source: RaysampleConfig | dict[str, Any] | str | Path) -> RaysampleConfig:
    """Validate a config given as an object, a dict, or a YAML file path."""
    if isinstance(source, RaysampleConfig):
        return source
    if isinstance(source, (str, Path)):
        path = Path(source)
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from exc
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(f"config {path} is not valid YAML{where}: {problem}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config {path} must be a mapping at the top level")
        source = data
    try:
        return RaysampleConfig.model_validate(source)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc)) from None


def resolve(source: RaysampleConfig | dict[str, Any] | str | Path) -> RaysampleConfig:
    """The configuration of one run, with its model's facts read once: the tiny model built or the GGUF
    converted, the Hugging Face config read and max_model_len checked against the model's limit. Entry
    points call this; everything below reads ``config.facts``. A resolved configuration comes back as it is."""
    config = load_config(source)
    if config.resolved:
        return config
    from workers.model.model_facts import ModelFacts

    model = config.model
    resolved = config.model_copy()
    resolved._facts = ModelFacts.read(model.resolve_path(), model.tokenizer, model.max_model_len,
                                      model.trust_remote_code)
    return resolved
