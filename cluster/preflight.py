"""Preparing a run, once, where it starts: the config loaded, checked before Ray or any worker starts (a bad
job fails in seconds with one line), and its model's facts read (``cluster.config.resolve``, so a model that
cannot be converted or read, or a max_model_len past its limit, is one of those lines)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from cluster.config import ProcessorItem, RaysampleConfig, load_config, resolve


class PreflightError(ValueError):
    """The job cannot run; the message is one line naming the cause."""


def prepare_run(source: RaysampleConfig | dict[str, Any] | str | Path, local: bool) -> RaysampleConfig:
    """The run's configuration, prepared once by the entry point where the run starts (``LLM``, the job, Ray
    Data's driver, an engine built on its own): loaded, checked, and its model's facts read (``config.facts``,
    what everything below reads). ``local``: for the in-process engine. A prepared config comes back as it
    is, checked again only for what differs where it is used (a Ray Data actor's engine in process)."""
    config = load_config(source)
    if not config.resolved:
        _check_processors(config)
        check_model_source(config)
        _check_gpus(config, local)
        config = _resolved(config)
        check_lora_modules(config)
    if local and config.cluster.num_engines > 1:
        raise PreflightError(local_engines_message(config))
    check_tensor_parallel(config, local)
    return config



def check_lora_modules(config: RaysampleConfig) -> None:
    """The adapters the config names (``lora.modules``, ``--lora-modules``) can run on this model: checked
    from their files before the engine starts, as vLLM checks its ``--lora-modules`` at start-up."""
    from workers.model.lora_files import AdapterError, read_adapter

    for name, path in config.lora.modules.items():
        try:
            read_adapter(path, config.facts.hf_config, config.lora.max_lora_rank)
        except AdapterError as exc:
            raise PreflightError(f"lora.modules[{name!r}]: {exc}") from None


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
    """How to make a package that is not importable here reach the job: under ``ray job submit`` a package
    outside --working-dir must be shipped with it; run as ``raysample`` (a console script), a package in the
    current directory is not on the import path, though ``python -m cluster.entrypoints.job`` puts it there."""
    from cluster.job_paths import JOB_CONFIG_ENV

    missing = _missing_module(exc)
    if missing is None:
        return ""
    if JOB_CONFIG_ENV in os.environ:
        return (" A package outside --working-dir must be shipped with the job: "
                "--runtime-env-json '{\"py_modules\": [\"/path/to/my_package\"]}' or '{\"pip\": [\"my-package\"]}'")
    top = missing.split(".")[0]
    here = Path.cwd()
    on_path = any(Path(entry or ".").resolve() == here.resolve() for entry in sys.path)
    if not on_path and ((here / top / "__init__.py").is_file() or (here / f"{top}.py").is_file()):
        return (f" {top!r} is in the current directory, which the raysample command does not import from: run it "
                f"as PYTHONPATH=$PWD raysample ..., or python -m cluster.entrypoints.job ..., or pip install it")
    return ""


def _missing_module(exc: BaseException) -> str | None:
    """The module an import failure names (``No module named 'x'``), or None for another failure."""
    for error in (exc, exc.__cause__):
        if isinstance(error, ModuleNotFoundError) and error.name:
            return error.name
    match = re.search(r"No module named '([\w.]+)'", str(exc))
    return match.group(1) if match else None


HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")  # "name" or "org/name", as the Hugging Face hub spells them


def check_model_source(config: RaysampleConfig) -> None:
    """A model path that is plainly not a folder or a hub id is refused before anything is read; a hub id
    (the model's or the tokenizer's) that is not in the local Hugging Face cache while the hub cannot be
    reached is refused in one line, instead of a minute of retries ending in the same error."""
    path = config.model.path
    if path is not None and config.model.gguf() is None and not Path(path).expanduser().is_dir():
        if path.startswith((".", "/", "~")) or Path(path).expanduser().is_file() or not HUB_ID.match(path):
            raise PreflightError(f"model.path {path!r} is not a directory")
        _check_hub_id("model.path", path, "config.json")
    tokenizer = config.model.tokenizer
    if tokenizer is not None and not Path(tokenizer).expanduser().is_dir() and HUB_ID.match(tokenizer) \
            and not tokenizer.startswith((".", "~")):
        _check_hub_id("model.tokenizer", tokenizer, "tokenizer_config.json")


def _check_hub_id(field: str, repo_id: str, probe_file: str) -> None:
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE or isinstance(try_to_load_from_cache(repo_id, probe_file), str):
        return  # offline mode reads the cache and says itself what is missing; a cached repo needs no network
    reason = hub_unreachable(constants.ENDPOINT)
    if reason is not None:
        raise PreflightError(f"{field} {repo_id!r} is not a local directory and not in the Hugging Face cache "
                             f"({constants.HF_HUB_CACHE}), and {constants.ENDPOINT} cannot be reached ({reason}): "
                             "download it where the hub can be reached, or give a local directory")


def hub_unreachable(endpoint: str, timeout_s: float = 3.0) -> str | None:
    """Why the hub's host cannot be reached (a name that does not resolve, a refused or silent port), or None."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout=timeout_s).close()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


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
