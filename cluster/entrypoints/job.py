"""Batch generation from JSON lines: ``raysample generate`` / ``python -m cluster.entrypoints.job generate``.

    raysample generate --config configs/default.yaml --input prompts.jsonl --output results.jsonl
    ray job submit --working-dir . -- python -m cluster.entrypoints.job generate --config ... --input ... --output ...

Input lines: ``{"id": ..., "prompt": "..." | "prompt_token_ids": [...], "sampling_params": {...},
"extra_args": {...}}`` (``vllm_xargs`` is accepted for ``extra_args``). The input is streamed, the
engine kept full, each result written (and flushed) as it finishes. Rerunning with the same output
skips ids already written. A bad line or bad parameters give an error record for that line only;
the exit code is non-zero only when the job itself fails.

Read in order: ``job_lines`` (input), ``job_formats`` (the two line formats), ``job_runner``
(the loop), ``job_records`` (output), ``job_progress``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

# Only the standard library above: the rest (torch, Ray, pydantic) is imported in ``_run``, after the
# signal handlers are in place and held while torch loads, so Ctrl-C or SIGTERM in those seconds is an
# interrupt like any other: one line and the exit code, no traceback.

logger = logging.getLogger("raysample.job")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _run_options(command: argparse.ArgumentParser) -> None:
    """The options ``generate`` and ``run-batch`` share, with their help."""
    command.add_argument("--config", required=True, type=Path, help="YAML config (see configs/)")
    command.add_argument("--overwrite", action="store_true", help="start the output afresh instead of resuming")
    command.add_argument("--local", action="store_true", help="run the engine in this process instead of on Ray")
    command.add_argument("--max-in-flight", type=positive_int, default=None,
                         help="requests submitted ahead (default 2 x max_num_seqs)")
    command.add_argument("--show", type=int, default=0, help="print the first N results")
    command.add_argument("--log-every", type=float, default=10.0,
                         help="seconds between progress lines when not on a terminal")
    command.add_argument("--verbose", action="store_true",
                         help="full tracebacks, and Ray's and the workers' own log lines")
    command.add_argument("--job-name", default=None,
                         help="the engine's name on the cluster (Engine.connect(name)); default: a new unique one")
    command.add_argument("-tp", "--tensor-parallel-size", type=positive_int, default=None,
                         help="ranks per worker, as vLLM's flag (overrides model.tensor_parallel_size)")
    command.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                         help="LoRA adapters a line selects by its model name, as vLLM's flag (adds to lora.modules)")
    command.add_argument("--max-lora-rank", type=positive_int, default=None, help="lora.max_lora_rank")
    command.add_argument("--max-loras", type=positive_int, default=None, help="lora.max_loras")


def with_lora_options(config: Any, args: argparse.Namespace) -> Any:
    """The config with ``--lora-modules``, ``--max-lora-rank`` and ``--max-loras`` laid over its lora section."""
    from cluster.config import ConfigError
    from cluster.entrypoints.lora_names import parse_lora_modules

    update: dict[str, Any] = {}
    if args.lora_modules:
        try:
            update["modules"] = {**config.lora.modules, **parse_lora_modules(args.lora_modules)}
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        update["enabled"] = True
    if args.max_lora_rank is not None:
        update["max_lora_rank"] = args.max_lora_rank
    if args.max_loras is not None:
        update["max_loras"] = args.max_loras
    return config.model_copy(update={"lora": config.lora.model_copy(update=update)}) if update else config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raysample", description="Batch LLM generation on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate for every line of a JSONL file")
    gen.add_argument("--input", required=True, type=Path, help="JSON lines with id, prompt, sampling_params")
    gen.add_argument("--output", required=True, type=Path, help="JSON lines results; resumed if it exists")
    _run_options(gen)
    batch = sub.add_parser("run-batch", help="an OpenAI batch file (as vllm run-batch): chat and completions lines")
    batch.add_argument("-i", "--input-file", dest="input", required=True, type=Path, help="OpenAI batch JSONL")
    batch.add_argument("-o", "--output-file", dest="output", required=True, type=Path, help="results; resumed if it exists")
    _run_options(batch)
    batch.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the names a line's body.model may give (model.served_model_name; default: the model "
                            "as configured); another gets vLLM's 404 record")
    return parser


def interrupted_message(output: Path, overwrite: bool = False) -> str:
    hint = " without --overwrite" if overwrite else ""
    return (f"\nraysample: interrupted; the results so far are in {output}. Re-running the same command{hint} "
            "resumes where this run stopped.")


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is (a scheduler's stop, ``kill``): every result so far is kept."""


_terminated = threading.Event()  # Ray's wait turns any exception a handler raises into KeyboardInterrupt


def _terminate(signum: int, frame: Any) -> None:
    _terminated.set()
    raise Terminated()


def handle_sigterm() -> None:
    """SIGTERM raises ``Terminated`` in the main thread (``cluster.ray.ray_cluster.ensure_ray`` keeps it
    over Ray's own, which aborts with a native stack dump: exit 134)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block ends, then act as they would have.

    For imports of native libraries: torch calls back into Python from C++ while it loads, and an
    interrupt raised in such a callback cannot unwind through the C++ frames (``terminate called after
    throwing an instance of 'pybind11::error_already_set'``, exit 134)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: arrived.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if arrived:
        if arrived[0] == signal.SIGTERM:
            _terminated.set()
            raise Terminated()
        raise KeyboardInterrupt()


def prompt_tokens_line(stats: dict) -> str:
    """Prompt tokens computed against given (once per sequence: a request with ``n`` = 2 gives its prompt
    twice, its second sequence reading the first's blocks): what the prefix cache saved."""
    given, computed = stats.get("prompt_tokens") or 0, stats.get("prefill_tokens") or 0
    if computed <= given:
        saved = f"{1 - computed / given:.0%} found in the prefix cache" if given else "none given"
    elif stats.get("preemptions"):
        saved = f"more: {stats['preemptions']} preempted request(s) were recomputed"
    else:
        saved = "more: requests re-run after a failure were recomputed"
    return f"prompt tokens: {computed} computed of {given} given ({saved})"


def interrupted(exc: KeyboardInterrupt, args: argparse.Namespace) -> int:
    """One line with the resume hint; 143 for SIGTERM, 130 for Ctrl-C (128 + the signal, as shells report)."""
    print(interrupted_message(args.output, getattr(args, "overwrite", False)), file=sys.stderr, flush=True)
    return 128 + (signal.SIGTERM if isinstance(exc, Terminated) or _terminated.is_set() else signal.SIGINT)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # huggingface_hub prints through a handler of its own and would print each line again through ours.
    logging.getLogger("huggingface_hub").propagate = False
    handle_sigterm()
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt as exc:  # at any point: starting up included; every result so far is written
        return interrupted(exc, args)
    except SystemExit as exc:
        if exc.code != signal.SIGTERM:
            raise
        # SIGTERM while ray.init ran: Ray's handler (sys.exit(15)) held the signal for that moment
        return interrupted(Terminated(), args)
    except Exception as exc:
        cause = interrupt_behind(exc)
        if cause is None:
            raise
        return interrupted(cause, args)


def interrupt_behind(exc: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C (or SIGTERM) that ``exc`` was raised while unwinding, if any. An interrupt landing
    inside ``threading``'s own locking (``Thread.start`` waiting for the thread: the job starts its
    tokenizer thread as the engine starts) leaves the lock half released, and the ``with`` around it
    raises ``RuntimeError: release unlocked lock`` over the interrupt: that is still the interrupt."""
    seen: set[int] = set()
    context = exc.__context__
    while context is not None and id(context) not in seen:
        if isinstance(context, KeyboardInterrupt):
            return context
        seen.add(id(context))
        context = context.__context__
    return None


def cli() -> NoReturn:
    """The ``raysample`` command (and ``python -m cluster.entrypoints.job``): ``main``, then out."""
    try:
        code = main()
    except KeyboardInterrupt:  # before the arguments were read
        print("\nraysample: interrupted", file=sys.stderr, flush=True)
        code = 130
    exit_now(code)


def exit_now(code: int) -> NoReturn:
    """Leave once the summary is written, whatever threads remain.

    A step abandoned in a hung processor, or a compute thread inside a torch kernel when Ctrl-C
    came, may never finish: the interpreter's exit would wait for it forever (the threads of a
    ``ThreadPoolExecutor`` are joined) or stop it from under a native frame that cannot unwind
    ("terminate called without an active exception", exit 134). So the exit handlers run (Ray's
    shutdown among them), output is flushed, and the process ends without tearing down threads.
    """
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _configured(config: Any, args: argparse.Namespace) -> Any:
    """The config with the command line's overrides laid over it (job name, tensor parallelism, served names,
    adapters)."""
    if args.job_name:
        config = config.model_copy(update={"cluster": config.cluster.model_copy(
            update={"coordinator_name": args.job_name})})
    if args.tensor_parallel_size is not None:
        config = config.model_copy(update={"model": config.model.model_copy(
            update={"tensor_parallel_size": args.tensor_parallel_size})})
    if getattr(args, "served_model_name", None):
        config = config.model_copy(update={"model": config.model.model_copy(
            update={"served_model_name": args.served_model_name})})
    return with_lora_options(config, args)


def _start_engine(config: Any, args: argparse.Namespace) -> tuple[Any, float] | None:
    """The engine (Ray first, unless ``--local``) and when Ray was up; None where it could not start (said)."""
    from cluster.entrypoints.engine_factory import build_engine

    ray_up = time.monotonic()
    try:
        if not args.local:
            from cluster.ray.ray_cluster import ensure_ray

            ensure_ray(config)  # first, so that the time to the first result counts from here
            ray_up = time.monotonic()
        return build_engine(config, local=args.local), ray_up
    except Exception as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"raysample: the engine could not start: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
              " (--verbose shows the traceback)", file=sys.stderr)
        return None


def _summary(args: argparse.Namespace, counters: Any, stats: dict, ray_up: float) -> int:
    """The job's closing lines; 1 where the engine failed requests a resume retries, else 0."""
    elapsed = time.monotonic() - counters.started
    acceptance = stats.get("spec_acceptance")
    where = "the engine started (--local)" if args.local else "Ray was up"
    first = "" if counters.first_result is None else f"; first result {counters.first_result - ray_up:.1f}s after {where}"
    print(
        f"[raysample] summary: {counters.done} requests done, {counters.errors} errors, "
        f"{counters.skipped} skipped (already in {args.output}); {counters.tokens} tokens in {elapsed:.1f}s "
        f"= {counters.rate():.0f} tokens/s; spec acceptance "
        + ("n/a" if acceptance is None else f"{acceptance:.0%}") + first,
        flush=True,
    )
    print(f"[raysample] {prompt_tokens_line(stats)}", flush=True)
    if counters.first_errors:
        shown = len(counters.first_errors)
        print(f"[raysample] {'the first ' + str(shown) + ' of ' if shown < counters.errors else ''}"
              f"{counters.errors} error(s), each a record with \"error\" in {args.output}:", flush=True)
        for line in counters.first_errors:
            print(f"[raysample]   {line}", flush=True)
    if counters.retryable:  # the engine failed them, not the requests: the caller should resume
        print(f"raysample: {counters.retryable} request(s) failed because the engine did (written with "
              f"\"retryable\": true); re-running the same command retries them", file=sys.stderr, flush=True)
        return 1
    return 0


def _locked_output(args: argparse.Namespace) -> TextIO:
    """The output, locked against a second job, emptied with ``--overwrite``, else its torn records set aside
    (said in one line); OutputLocked or OutputUnwritable where it cannot be."""
    from cluster.entrypoints.job_records import lock_output, rejected_path, set_aside_torn

    lock = lock_output(args.output)
    try:
        torn = 0 if args.overwrite else set_aside_torn(args.output)
        if args.overwrite:
            lock.truncate(0)
        elif torn:
            lock.close()
            lock = lock_output(args.output)  # the rewritten file is a new one
    except BaseException:
        lock.close()
        raise
    if torn:
        print(f"raysample: warning: {torn} torn record(s) in {args.output} (not a JSON object) were moved to "
              f"{rejected_path(args.output)}; their lines run again", file=sys.stderr, flush=True)
    return lock


def _run(args: argparse.Namespace) -> int:
    with signals_held():  # torch loads with these modules: an interrupt waits until it has
        from cluster.config import ConfigError, load_config
        from cluster.entrypoints import job_runner
        from cluster.entrypoints.engine_factory import build_engine  # noqa: F401 - loaded while signals wait
        from cluster.entrypoints.job_formats import GenerateFormat, OpenAIBatchFormat, pending_lines
        from cluster.entrypoints.job_lines import input_lines
        from cluster.entrypoints.job_progress import describe_start
        from cluster.entrypoints.job_records import OutputLocked, OutputUnwritable
        from cluster.job_paths import JobPathError, check_job_paths
        from cluster.preflight import PreflightError, prepare_run
        from cluster.quiet import quiet_libraries

    try:
        config = _configured(load_config(args.config), args)
        check_job_paths(args.input, args.output, args.config)
    except (ConfigError, JobPathError) as exc:
        print(f"raysample: {exc}", file=sys.stderr)
        return 2
    format_of = OpenAIBatchFormat if args.command == "run-batch" else GenerateFormat
    line_format = format_of(config)  # ids only, until the configuration is resolved
    if args.overwrite:
        total = pending = sum(1 for _ in input_lines(args.input))
    else:
        total, pending = pending_lines(line_format, args.input, args.output)
    if pending == 0:
        print(f"[raysample] nothing to do: all {total} lines of {args.input} already have a record in {args.output} "
              "(--overwrite starts afresh)", flush=True)
        return 0
    if args.verbose:
        os.environ["RAYSAMPLE_VERBOSE"] = "1"  # a private instance's engine processes inherit it
    else:
        quiet_libraries()
    try:
        config = prepare_run(config, args.local)  # once here; everything below reads config.facts
    except PreflightError as exc:
        print(f"raysample: {exc}", file=sys.stderr)
        return 2
    line_format = format_of(config)
    try:
        lock = _locked_output(args)  # held until the job ends
    except (OutputLocked, OutputUnwritable) as exc:
        print(f"raysample: {exc}", file=sys.stderr)
        return 2
    try:  # the output's lock is let go however the job ends (a caller's process may go on)
        resumed = f" ({total - pending} already in {args.output})" if pending < total else ""
        print(f"[raysample] starting {describe_start(config, args.local)} for {pending} request(s){resumed}", flush=True)
        line_format.prefetch_tokenizer()
        started = _start_engine(config, args)
        if started is None:
            return 1
        backend, ray_up = started
        try:
            name = getattr(backend, "name", None)
            print(f"[raysample] {'engine ' + name + ': ' if name else ''}{backend.stats()['kv_cache']}", flush=True)
            counters = job_runner.run_job(config, backend, args.input, args.output,
                               args.max_in_flight or 2 * config.scheduler.max_num_seqs, args.show, args.log_every,
                               line_format)
            stats = backend.stats()
        except KeyboardInterrupt as exc:
            # Every result so far was written and flushed as it finished; nothing is torn.
            return interrupted(exc, args)
        except Exception as exc:
            if args.verbose:
                traceback.print_exc()
            first = str(exc).splitlines()[0] if str(exc) else ""
            print(f"raysample: the job failed: {type(exc).__name__}: {first}" + ("" if args.verbose else
                  " (--verbose shows the traceback)") + f"; the results so far are in {args.output}, and re-running the "
                  "same command resumes", file=sys.stderr, flush=True)
            return 1
        finally:
            shut_down(backend, args.verbose)
        return _summary(args, counters, stats, ray_up)
    finally:
        lock.close()


def shut_down(backend: Any, verbose: bool) -> None:
    """Stop the engine; a failure here (the engine already gone, a second Ctrl-C) was reported or
    does not matter once the job has ended, so it prints nothing more."""
    try:
        backend.shutdown()
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001
        if verbose:
            print(f"raysample: stopping the engine: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    cli()
