"""What a careless or hostile user can do to a job, each in a process of its own as it would run.

A 50 MB line costs neither memory nor time; Ctrl-C while the engine starts exits cleanly with the
resume hint; a private Ray instance listens on loopback only. The one-line refusals (templates in
input lines, a max_model_len past the model's limit, engine failures' exit code) are in
``tests/test_edges.py``.
"""

from __future__ import annotations

import ast
import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import yaml
from helpers import tiny_job_config

ROOT = Path(__file__).resolve().parents[1]


def job(tmp_path: Path, lines: list[bytes], *extra: str) -> tuple[list[str], Path]:
    """The CLI on a tiny model in this process (``--local``); it prints its peak RSS on stderr when it exits."""
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(tiny_job_config()))
    (tmp_path / "in.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))
    output = tmp_path / "out.jsonl"
    output.unlink(missing_ok=True)
    run = ("import resource, sys; from cluster.job import main; code = main(sys.argv[1:]); "
           "print('MAXRSS_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(code)")
    args = [sys.executable, "-c", run, "generate", "--config", str(tmp_path / "c.yaml"), "--input",
            str(tmp_path / "in.jsonl"), "--output", str(output), "--local", *extra]
    return args, output


def peak_mib(stderr: str) -> float:
    return int(next(line.split()[1] for line in stderr.splitlines() if line.startswith("MAXRSS_KIB"))) / 1024


def test_a_50_mb_line_costs_no_memory_and_no_time(tmp_path):
    big = json.dumps({"id": "big", "prompt": "x" * (50 << 20)}).encode()
    good = json.dumps({"id": "good", "prompt": "Hello", "sampling_params": {"max_tokens": 4}}).encode()
    args, _ = job(tmp_path, [good])
    clean = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert clean.returncode == 0, clean.stderr[-2000:]
    args, output = job(tmp_path, [big, good])
    started = time.monotonic()
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-2000:]
    records = {r["id"]: r for r in map(json.loads, output.read_text().splitlines())}
    assert records[None]["error"].startswith(f"line is {len(big) + 1} bytes: more than any request")
    assert records["good"]["error"] is None
    grew = peak_mib(done.stderr) - peak_mib(clean.stderr)
    assert grew < 32, grew  # read through in 1 MiB pieces, never held (holding it alone is 50 MiB)
    assert elapsed < 60, elapsed  # tokenizing it first took 75 s and 9 GiB


def test_ctrl_c_while_the_engine_starts_exits_130_with_the_resume_hint(tmp_path):
    args, _ = job(tmp_path, [json.dumps({"id": 1, "prompt": "Hi"}).encode()])
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()  # "[raysample] starting ...": the engine is starting now
    assert first.startswith("[raysample] starting"), first
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Re-running the same command resumes" in err and "Traceback" not in err, err[-2000:]


def test_a_private_ray_instance_listens_on_loopback_only():
    script = textwrap.dedent("""
        import psutil, ray
        from cluster.config import load_config
        from cluster.ray_cluster import ensure_ray
        ensure_ray(load_config({"model": {"tiny": "default"}}))
        ray.get(ray.remote(lambda: 1).remote())  # a worker process too
        listening = set()
        for process in psutil.Process().children(recursive=True):
            try:
                for conn in process.net_connections(kind="inet"):
                    if conn.status == psutil.CONN_LISTEN:
                        listening.add(conn.laddr.ip)
            except psutil.Error:
                pass
        print("LISTEN", sorted(listening))
        print("METRICS", ray.nodes()[0]["NodeManagerAddress"])
        ray.shutdown()
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("LISTEN", "METRICS")))
    addresses = ast.literal_eval(lines["LISTEN"])
    assert addresses and all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for ip in addresses), addresses
    assert lines["METRICS"] == "127.0.0.1"
