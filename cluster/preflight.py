"""Checks on the driver before Ray or any worker starts: a bad job fails in seconds with one line.

``preflight`` also resolves the run's configuration (``cluster.config.resolve``), so a model that cannot
be converted or read, or a max_model_len past its limit, is one of those lines."""

from __future__ import annotations

import os
from pathlib import Path

from cluster.config import ProcessorItem, RaysampleConfig, resolve


class PreflightError(ValueError):
    """The job cannot run; the message is one line naming the cause."""


def preflight(config: RaysampleConfig, local: bool) -> RaysampleConfig:
    """The run's configuration, resolved once here (``config.facts``), once every check passed."""
    _check_processors(config)
    _check_model_source(config)
    _check_gpus(config, local)
    if local and config.cluster.num_engines > 1:
        raise PreflightError(local_engines_message(config))
    resolved = _resolved(config)
    check_tensor_parallel(resolved, local)
    return resolved


def check_tensor_parallel(config: RaysampleConfig, local: bool) -> None:
    """A tensor-parallel size the model cannot be split into, or one the in-process engine cannot
    run, is refused before any rank starts (vLLM refuses the same sizes)."""
    size = config.model.tensor_parallel_size
    if size == 1:
        return
    if local:
        raise PreflightError(f"model.tensor_parallel_size={size} needs Ray (one process per rank): the in-process "
                             "engine (--local, LocalEngine, LLM(local=True)) holds whole models; drop --local")
    if config.model.simulate is not None:
        return  # ranks that sleep their share of the modelled step (workers.doubles.simulated_runner)
    from workers.model.tensor_parallel import check_divisible, valid_sizes

    model_config = resolve(config).facts.hf_config
    if not getattr(model_config, "base_model_tp_plan", None):
        arch = (getattr(model_config, "architectures", None) or [model_config.model_type])[0]
        raise PreflightError(f"model.tensor_parallel_size={size}: transformers has no tensor-parallel plan for {arch} "
                             "(base_model_tp_plan in its config); set tensor_parallel_size to 1")
    try:
        check_divisible(model_config, size)
    except ValueError as exc:
        sizes = ", ".join(str(n) for n in valid_sizes(model_config, largest=16))
        raise PreflightError(f"model.tensor_parallel_size: {exc} This model splits into {sizes}.") from None


def local_engines_message(config: RaysampleConfig) -> str:
    return (f"cluster.num_engines={config.cluster.num_engines} needs Ray: the in-process engine (--local, "
            "LocalEngine, LLM(local=True)) is one engine; drop --local or set cluster.num_engines to 1")


def _check_processors(config: RaysampleConfig) -> None:
    from processors.builtins.request_level import import_target
    from processors.loading import load_custom_processors

    try:
        load_custom_processors(config.custom_processors(), config.processors_from_entry_points)
    except Exception as exc:
        raise PreflightError(f"processors: {exc}{_shipping_hint(exc)}") from None
    for item in config.processors:
        if isinstance(item, ProcessorItem) and item.request_level and isinstance(item.class_, str):
            try:
                target = import_target(item.class_)
            except Exception as exc:
                raise PreflightError(f"processors: request-level {item.class_!r} cannot be imported "
                                     f"({type(exc).__name__}: {exc}).{_shipping_hint(exc)}") from None
            if not callable(target):
                raise PreflightError(f"processors: request-level {item.class_!r} is not callable")


def _shipping_hint(exc: Exception) -> str:
    """Under ``ray job submit`` a package outside --working-dir is invisible unless the job ships it."""
    from cluster.job_paths import JOB_CONFIG_ENV

    missing = isinstance(exc, ImportError) or isinstance(exc.__cause__, ImportError) or "No module named" in str(exc)
    if not missing or JOB_CONFIG_ENV not in os.environ:
        return ""
    return (" A package outside --working-dir must be shipped with the job: "
            "--runtime-env-json '{\"py_modules\": [\"/path/to/my_package\"]}' or '{\"pip\": [\"my-package\"]}'")


def _check_model_source(config: RaysampleConfig) -> None:
    """A model path that is plainly a file, not a folder or a hub id, is refused before anything is read."""
    path = config.model.path
    if path is None or config.model.gguf() is not None or Path(path).is_dir():
        return
    if path.startswith((".", "/", "~")) or Path(path).suffix:
        raise PreflightError(f"model.path {path!r} is not a directory")


def _resolved(config: RaysampleConfig) -> RaysampleConfig:
    """``resolve``, its failures as one line: a GGUF that cannot be converted, a config that cannot be
    read (a hub id not reachable), a max_model_len past the model's limit (vLLM refuses it too)."""
    from workers.model.model_source import ModelSourceError

    try:
        return resolve(config)
    except ModelSourceError as exc:
        raise PreflightError(f"model: {exc}") from None
    except ValueError as exc:
        if str(exc).startswith("model.max_model_len="):
            raise PreflightError(str(exc)) from None
        if config.model.gguf() is not None:
            raise PreflightError(f"model: {exc}") from None
        raise PreflightError(_unreadable(config, exc)) from None
    except Exception as exc:
        raise PreflightError(_unreadable(config, exc)) from None


def _unreadable(config: RaysampleConfig, exc: Exception) -> str:
    path = config.model.path
    cause = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if path is None or Path(path).expanduser().is_dir() or config.model.gguf() is not None:
        return f"model: cannot be read ({cause})"
    return f"model.path {path!r} is neither a local directory nor a reachable hub id ({cause})"


def _check_gpus(config: RaysampleConfig, local: bool) -> None:
    cluster = config.cluster
    joins_cluster = cluster.address != "local" or bool(os.environ.get("RAY_ADDRESS"))
    if cluster.gpus_per_worker <= 0 or (not local and joins_cluster):
        return  # a cluster's GPUs are checked against its resources as soon as Ray is joined
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    engines = 1 if local else cluster.num_engines
    wanted = cluster.gpus_per_worker * cluster.num_workers * engines * config.model.tensor_parallel_size
    if visible < wanted:
        where = "this process (--local)" if local else "this host (address: local)"
        per = f" x {engines} engines" if engines > 1 else ""
        if config.model.tensor_parallel_size > 1:
            per += f" x {config.model.tensor_parallel_size} ranks (model.tensor_parallel_size)"
        raise PreflightError(f"cluster.gpus_per_worker={cluster.gpus_per_worker} x {cluster.num_workers} workers{per} needs "
                             f"{wanted:g} GPU(s); {where} sees {visible}")
