"""Ray Data datasets through raysample engines: ``build_processor(config)(dataset)``.

    from cluster.entrypoints.data import build_processor
    processor = build_processor("configs/default.yaml")
    processor(ray.data.read_parquet("in.parquet")).write_parquet("out/")

Input rows carry one of ``prompt``, ``messages`` or ``prompt_token_ids``, and optionally
``sampling_params`` (vLLM's fields), ``extra_args`` (or ``vllm_xargs``) and ``id``. Output
rows are the input rows plus ``generated_text``, ``generated_token_ids``, ``finish_reason``,
``num_generated_tokens``, ``num_input_tokens``, ``prompt_logprobs`` (null unless the row's sampling_params
ask for them: then null for the first prompt token, and for each other its ``token_id``, ``logprob``, ``rank``
and the most likely ``top_token_ids`` with their ``top_logprobs``) and ``error``. A row that cannot run gets its
reason in ``error`` and the dataset goes on; the rules are the JSONL job's, with one more that
Arrow imposes: a null field is an unset one (Arrow gives every row of a column every field).

The engines are a Ray Data actor pool, one raysample engine per actor (``cluster.num_engines``
actors): with one worker per engine the engine runs inside the actor, which holds that
worker's CPUs or GPU; with more, the actor starts an engine on Ray with its own placement group.
An actor that dies is restarted by Ray Data and its batch runs again: outputs are keyed by
seed or id, so they come out the same. A row with an ``id`` samples as the JSONL job's line
with that id would; rows without one draw fresh randomness unless seeded.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cluster.config import RaysampleConfig, load_config
from cluster.entrypoints.engine_factory import build_engine
from cluster.entrypoints.job_lines import BadLine, engine_request_id, id_key, parse_line
from cluster.entrypoints.lora_names import LoraNames
from cluster.preflight import prepare_run
from cluster.ray.engine_handle import with_engine_name

Row = dict[str, Any]

OUTPUT_COLUMNS = ("generated_text", "generated_token_ids", "finish_reason", "num_generated_tokens",
                  "num_input_tokens", "prompt_logprobs", "error")
INPUT_FIELDS = ("id", "prompt", "prompt_token_ids", "messages", "chat_template_kwargs", "sampling_params",
                "extra_args", "vllm_xargs", "model")
DEFAULT_BATCH_SIZE = 64


def _unset_nulls(value: Any) -> Any:
    """Arrow fills the fields a row lacks with nulls; here they are unset again."""
    if isinstance(value, dict):
        return {k: _unset_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_unset_nulls(v) for v in value]
    return value


def row_request(row: Row, defaults: dict[str, Any], tokenizer: Callable[[], Any],
                adapters: LoraNames | None = None) -> tuple[str, Any, Any]:
    """(engine request id, prompt, SamplingParams) of one row, by the JSONL job's rules; ``BadLine`` if it cannot
    run. A ``model`` column names the row's LoRA adapter, as Ray Data LLM's (``adapters``)."""
    try:
        record = {k: _unset_nulls(row[k]) for k in INPUT_FIELDS if row.get(k) is not None}
        rid = record.get("id")
        record["id"] = rid if rid is not None else f"row-{uuid.uuid4().hex}"
        text = json.dumps(record)
    except RecursionError:  # parse_line refuses past 64 levels; this deep, even writing it out fails
        raise BadLine("the row nests objects/arrays too deeply to be read") from None
    _, prompt, params = parse_line(text, defaults, tokenizer, adapters=adapters)
    if params.n != 1:
        raise BadLine(f"n={params.n}: a dataset row holds one completion; give one row per sample (with distinct "
                      "seeds or ids)")
    if params.logprobs is not None:
        raise BadLine("logprobs have no output column here; use the JSONL job for them")
    return engine_request_id(id_key(rid)) if rid is not None else f"row:{uuid.uuid4().hex}", prompt, params


def engine_in_actor(config: RaysampleConfig) -> bool:
    """One worker of one rank: the engine runs inside the Ray Data actor. Else it places its own
    workers (and their tensor-parallel ranks), and the actor only drives it."""
    return config.cluster.num_workers == 1 and config.model.tensor_parallel_size == 1


class EngineStage:
    """The Ray Data UDF: one raysample engine per actor, a batch of rows in, the same rows plus outputs out."""

    def __init__(self, config: dict[str, Any], preprocess: Callable[[Row], Row] | None = None,
                 postprocess: Callable[[Row], Row] | None = None, engine_prefix: str | None = None) -> None:
        """``engine_prefix``: this dataset's engines are named with it (see ``Processor.__call__``)."""
        from cluster.quiet import quiet_libraries

        quiet_libraries()
        config = load_config(config)  # the driver prepared it: the facts travel with it
        self.config = config if engine_prefix is None else with_engine_name(config, engine_prefix)
        self.adapters = LoraNames.of(config)
        self.preprocess, self.postprocess = preprocess, postprocess
        # One worker: the engine runs in this actor, which holds that worker's CPUs or GPU.
        local = engine_in_actor(self.config)
        self.engine: Any = build_engine(self.config, local=local)
        # Shut the engine down when Ray Data drops this object. It does not always get to: when the actor
        # is let go without that, the engine's placement group (which belongs to the job, not to this
        # actor) stays, and the driver releases it (``Processor.__call__``).
        self._shutdown = weakref.finalize(self, _shut_down, self.engine)
        if local:
            self._tokenizer = self.engine.tokenizer
        else:
            from cluster.entrypoints.chat import load_tokenizer

            facts = self.config.facts
            self._tokenizer = load_tokenizer(facts.tokenizer, facts.trust_remote_code)

    def __call__(self, batch: Any) -> Any:
        """``batch``: a pyarrow Table; the result keeps its columns and adds ``OUTPUT_COLUMNS``.

        The row functions run here, not as Ray Data ``map``s: a row map infers each block's types
        from its own rows, and blocks whose nested fields came out null in one and typed in another
        cannot be joined into one batch."""
        import pyarrow as pa

        if self.preprocess is not None:
            batch = typed_like(pa.Table.from_pylist([self.preprocess(row) for row in batch.to_pylist()]), batch.schema)
        rows = batch.to_pylist()
        outputs: list[Row] = [{} for _ in rows]
        # Rows need not have distinct ids (a union of two sources, a file read twice) and batches are
        # cut anywhere: a row whose id an earlier row of this batch has runs in a later round under
        # that id, as it would in another batch, so no row's output depends on which rows share its batch.
        rounds: list[list[tuple[int, str, Any, Any]]] = []
        seen: dict[str, int] = {}
        params_of: dict[int, Any] = {}
        for i, row in enumerate(rows):
            try:
                rid, prompt, params = row_request(row, self.config.defaults, lambda: self._tokenizer, self.adapters)
            except BadLine as exc:
                outputs[i] = {"error": str(exc), "finish_reason": "error"}
                continue
            except Exception as exc:  # noqa: BLE001 - one odd row must not fail the dataset
                outputs[i] = {"error": f"{type(exc).__name__}: {exc}", "finish_reason": "error"}
                continue
            params_of[i] = params
            k = seen[rid] = seen.get(rid, -1) + 1
            if k == len(rounds):
                rounds.append([])
            rounds[k].append((i, rid, prompt, params))
        for submitted in rounds:
            ids = self.engine.submit_many([s[2] for s in submitted], [s[3] for s in submitted],
                                          [s[1] for s in submitted], final_only=True)
            final = self.engine.results(ids)
            for (i, *_), rid in zip(submitted, ids):
                out = final[rid]
                completion = out.outputs[0]
                outputs[i] = {
                    "generated_text": None if out.error else completion.text,
                    "generated_token_ids": None if out.error else list(completion.token_ids),
                    "finish_reason": completion.finish_reason.value if completion.finish_reason else None,
                    "num_generated_tokens": len(completion.token_ids),
                    "num_input_tokens": len(out.prompt_token_ids),
                    "prompt_logprobs": prompt_logprob_rows(out, params_of[i].prompt_logprobs),
                    "error": out.error,
                }
        result = with_output_columns(batch, outputs)
        if self.postprocess is None:
            return result
        return typed_like(pa.Table.from_pylist([self.postprocess(row) for row in result.to_pylist()]), result.schema)


def prompt_logprob_rows(out: Any, num_top: int | None) -> list[Row | None] | None:
    """The ``prompt_logprobs`` column of one row: None unless asked (and computed)."""
    if num_top is None or out.prompt_logprobs is None:
        return None
    from coordinator.request import top_of

    rows: list[Row | None] = [None]
    for token, position in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        top = top_of(position, token, num_top)[:num_top] if num_top else []
        rows.append({"token_id": token, "logprob": position[token].logprob, "rank": position[token].rank,
                     "top_token_ids": [t for t, _ in top], "top_logprobs": [lp.logprob for _, lp in top]})
    return rows


def _shut_down(engine: Any) -> None:
    try:
        engine.shutdown()
    except Exception:  # noqa: BLE001 - the actor is going away either way
        pass


def with_output_columns(batch: Any, outputs: list[Row]) -> Any:
    """The batch with the output columns (typed, so blocks of all-error rows still concatenate)."""
    import pyarrow as pa

    position = pa.struct([("token_id", pa.int64()), ("logprob", pa.float64()), ("rank", pa.int64()),
                          ("top_token_ids", pa.list_(pa.int64())), ("top_logprobs", pa.list_(pa.float64()))])
    types = {"generated_text": pa.string(), "generated_token_ids": pa.list_(pa.int64()),
             "finish_reason": pa.string(), "num_generated_tokens": pa.int64(), "num_input_tokens": pa.int64(),
             "prompt_logprobs": pa.list_(position), "error": pa.string()}
    for name in OUTPUT_COLUMNS:
        if name in batch.column_names:
            batch = batch.drop_columns([name])
        batch = batch.append_column(pa.field(name, types[name]),
                                    pa.array([o.get(name) for o in outputs], type=types[name]))
    return batch


def typed_like(table: Any, schema: Any) -> Any:
    """Columns typed from this batch's rows alone get the type they had before: a column, or a field
    nested in one, that is null in every row of a small batch comes out null-typed, and blocks (or
    Parquet files) typed so do not join the others. Only such columns are cast; a column whose type
    a row function changed keeps it."""
    import pyarrow as pa

    for i, field in enumerate(table.schema):
        if field.name not in schema.names or not _has_null_type(field.type):
            continue
        typed = schema.field(field.name)
        try:
            table = table.set_column(i, typed, table.column(i).cast(typed.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            pass  # the row function changed the column's shape: keep what its rows say
    return table


def _has_null_type(kind: Any) -> bool:
    import pyarrow as pa

    if pa.types.is_null(kind):
        return True
    if pa.types.is_struct(kind):
        return any(_has_null_type(kind.field(j).type) for j in range(kind.num_fields))
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _has_null_type(kind.value_type)
    return False


class Processor:
    """``processor(dataset)``: the dataset's rows through the engines, lazily, as a new ``Dataset``."""

    def __init__(self, config: RaysampleConfig, preprocess: Callable[[Row], Row] | None,
                 postprocess: Callable[[Row], Row] | None, batch_size: int) -> None:
        self.config = config
        self.preprocess, self.postprocess = preprocess, postprocess
        self.batch_size = batch_size

    def __call__(self, dataset: Any) -> Any:
        import ray

        from cluster.ray.ray_cluster import check_cluster_resources

        quiet_ray_data()
        config = self.config
        in_actor = engine_in_actor(config)
        engine_prefix = None
        if ray.is_initialized() and not in_actor:
            from cluster.ray.ray_cluster import DATASET_ENGINE_PREFIXES, release_orphaned_placements

            release_orphaned_placements(config.cluster.namespace)  # what earlier datasets' engines left held
            engine_prefix = f"raysample-data-{uuid.uuid4().hex[:8]}"
            DATASET_ENGINE_PREFIXES.append(engine_prefix)
        if ray.is_initialized():
            config = leave_room_for_ray_data(config, ray.cluster_resources().get("CPU", 0.0))
            if in_actor:  # the actors hold the workers: their KV budgets are planned here, for all of them
                from cluster.ray.memory_on_ray import plan_on_ray

                config, _ = plan_on_ray(config)
            check_cluster_resources(config)  # in seconds, not after Ray Data waits for resources forever
        cluster = config.cluster
        engines_config = config.model_copy(update={"cluster": cluster.model_copy(update={"num_engines": 1})})
        from ray.data import ActorPoolStrategy

        dataset = dataset.map_batches(
            EngineStage,
            fn_constructor_kwargs={"config": engines_config, "preprocess": self.preprocess,
                                   "postprocess": self.postprocess, "engine_prefix": engine_prefix},
            batch_format="pyarrow",
            batch_size=self.batch_size,
            compute=ActorPoolStrategy(size=cluster.num_engines),
            # One worker: the engine runs in the actor, which holds that worker's share. More: the
            # engine places its own workers, and the actor only drives it.
            num_cpus=cluster.cpus_per_worker if in_actor else 0,
            num_gpus=cluster.gpus_per_worker if in_actor else 0,
            memory=cluster.memory_per_worker if in_actor else None,
        )
        return dataset


def quiet_ray_data() -> None:
    """Ray Data logs its plan and, away from a terminal, a progress record every few seconds per
    operator: some 40 lines for 7 rows, 1,500 for a long job. Its warnings and errors still show;
    ``RAYSAMPLE_VERBOSE=1`` keeps it all (its full log is in the Ray session's folder either way)."""
    if not os.environ.get("RAYSAMPLE_VERBOSE"):
        logging.getLogger("ray.data").setLevel(logging.WARNING)


# Ray Data's own read and write tasks ask for a CPU each: the engines' workers leave at least this many.
RAY_DATA_CPUS = 1.0


def leave_room_for_ray_data(config: RaysampleConfig, cluster_cpus: float) -> RaysampleConfig:
    """The engines' workers hold their CPUs until the dataset is written: on a cluster they would fill (2
    CPUs, 2 workers of 1), Ray Data's write task never got a CPU and the dataset hung after its last
    generation. There each worker asks for an equal share of what leaves Ray Data one CPU, and one line
    says so; a cluster without even that is refused at once."""
    cluster = config.cluster
    ranks = cluster.num_engines * cluster.num_workers * config.model.tensor_parallel_size
    if cluster.gpus_per_worker > 0 or ranks * cluster.cpus_per_worker + RAY_DATA_CPUS <= cluster_cpus:
        return config
    share = (cluster_cpus - RAY_DATA_CPUS) / ranks
    if share < 0.01:
        raise RuntimeError(f"the Ray cluster has {cluster_cpus:g} CPU: Ray Data needs {RAY_DATA_CPUS:g} for its read "
                           f"and write tasks beside the engines' {ranks} worker(s); start Ray with more "
                           "(ray.init(num_cpus=...)) or run fewer workers (cluster.num_workers, cluster.num_engines)")
    share = int(share * 100) / 100
    print(f"[raysample] Ray Data: the cluster has {cluster_cpus:g} CPUs; the engines' {ranks} worker(s) ask for "
          f"{share:g} CPU each (cluster.cpus_per_worker was {cluster.cpus_per_worker:g}), leaving "
          f"{RAY_DATA_CPUS:g} for Ray Data's read and write tasks", flush=True)
    return config.model_copy(update={"cluster": cluster.model_copy(update={"cpus_per_worker": share})})


def build_processor(config: RaysampleConfig | dict[str, Any] | str | Path,
                    preprocess: Callable[[Row], Row] | None = None,
                    postprocess: Callable[[Row], Row] | None = None,
                    batch_size: int = DEFAULT_BATCH_SIZE) -> Processor:
    """A callable from a Ray Data ``Dataset`` to one with generations, on ``cluster.num_engines`` engines.

    ``preprocess`` / ``postprocess``: row functions run before and after each row's generation
    (inside the engine actors), as in Ray Data LLM's ``build_processor``.
    """
    return Processor(prepare_run(config, local=False), preprocess, postprocess, batch_size)  # once, on the driver
