"""Input and output paths of a batch job, including under ``ray job submit --working-dir``.

A job's driver runs in Ray's temporary copy of the working directory. A relative
input is read from that copy (the file was uploaded with it), but a relative
output would be written into the copy and deleted with it, so it is refused
with a message that says what to pass instead.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job supervisor for the entrypoint


class JobPathError(ValueError):
    """A path the job cannot use; one line saying why and what to pass."""


def ray_job_working_dir() -> str | None:
    """The ``working_dir`` URI of the Ray job this process is the entrypoint of, if any."""
    raw = os.environ.get(JOB_CONFIG_ENV)
    if not raw:
        return None
    try:
        runtime_env = json.loads(raw).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return None
    working_dir = runtime_env.get("working_dir")
    return str(working_dir) if working_dir else None


def check_job_paths(input_path: Path, output_path: Path, config_path: Path) -> None:
    under_job = ray_job_working_dir() is not None
    if under_job and not output_path.is_absolute():
        raise JobPathError(
            f"--output {output_path} is relative: under `ray job submit --working-dir` the job runs in Ray's "
            "temporary copy of the working directory, which is deleted when the job ends; pass an absolute path "
            f"(e.g. --output \"$PWD/{output_path}\") on a filesystem the head node can write")
    output_problem = unwritable(output_path)
    if output_problem:
        raise JobPathError(f"--output {output_path} cannot be written: {output_problem}")
    for flag, path in (("--input", input_path), ("--config", config_path)):
        if path.exists():
            continue
        if under_job and not path.is_absolute():
            raise JobPathError(
                f"{flag} {path} is not in the job's copy of --working-dir (files that .gitignore excludes are "
                "not uploaded); pass an absolute path the head node can read")
        raise JobPathError(f"{flag} {path} does not exist")
    check_distinct({"--input": input_path, "--config": config_path, "--output": output_path})


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (device and inode: through symlinks, ``./`` and hard links)."""
    try:
        first, second = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino)


def check_distinct(paths: dict[str, Path]) -> None:
    """Input, config and output must be three files: a job writing its output over its own input or
    config would destroy what it reads (``--output`` equal to ``--input`` truncated the input with
    ``--overwrite``). The output's ``.rejected`` file (torn records are moved there) counts as the output."""
    named = list(paths.items())
    output = paths.get("--output")
    if output is not None:
        named.append(("--output's .rejected file", output.with_name(output.name + ".rejected")))
    for i, (flag, path) in enumerate(named):
        for other_flag, other in named[i + 1:]:
            if other_flag.startswith("--output") and flag.startswith("--output"):
                continue
            if same_file(path, other):
                raise JobPathError(f"{flag} {path} and {other_flag} {other} are the same file; the job would "
                                   "write over what it reads: choose another output")


def unwritable(path: Path) -> str | None:
    """Why the job could not append to ``path`` (creating it and its folders), or None; creates nothing."""
    if path.is_dir():
        return "it is a directory"
    if path.exists():
        return None if os.access(path, os.W_OK) else "permission denied"
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"permission denied in {parent}"
    return None
