"""The workloads of bench/e2e.py (and bench/threads.py): chat prompts on the real tokenizer, random
token prompts, copy-heavy prompts for n-gram drafts, and the model folders they run on."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.model.tiny import ensure_tiny_model  # noqa: E402


BATCH = 64
MAX_MODEL_LEN = {"tiny": 256, "smollm2": 1024}
TOPICS = ["the moon", "volcanoes", "coffee", "the Roman empire", "honey bees", "rainbows", "chess", "bicycles",
          "the ocean", "jazz", "tea", "glaciers", "owls", "electricity", "bread", "the internet"]
FORMS = ["Tell me three facts about {}.", "Write a short poem about {}.", "Explain {} to a child.",
         "What is the history of {}?", "Give me a fun question about {}.", "Describe {} in two sentences.",
         "Why do people like {}?", "Write a haiku about {}."]
COPY_TEXTS = [  # long enough that a 64-token answer is mostly the copy
    "The quick brown fox jumps over the lazy dog near the river bank every morning, while the old farmer watches "
    "from his porch and drinks his coffee, and the children walk slowly to the small school at the end of the road.",
    "Monday: buy milk, eggs and bread. Tuesday: call the bank about the loan. Wednesday: water the plants in the "
    "garden. Thursday: pick up the dry cleaning. Friday: dinner with Sam and Alex at the new Italian place.",
    "Our office opens at nine in the morning and closes at five in the afternoon. It is closed on weekends and on "
    "public holidays. Visitors must sign in at the front desk and wear a badge at all times inside the building.",
    "Alice, 34, engineer; Bob, 29, designer; Carol, 41, manager; Dave, 25, intern; Erin, 38, accountant; Frank, "
    "45, lawyer; Grace, 31, nurse; Henry, 27, teacher; Irene, 52, doctor; Jack, 36, pilot.",
]


def model_dir_for(name: str, dtype: str) -> Path:
    if name == "tiny":
        return ensure_tiny_model("bench")
    from workers.model.model_source import gguf_to_transformers, preset_gguf

    return gguf_to_transformers(preset_gguf("smollm2-135m-instruct"), dtype)


def chat_workload(model_dir: Path, n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """Chat requests through the model's template, as users send them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        question = FORMS[i % len(FORMS)].format(TOPICS[(i // len(FORMS)) % len(TOPICS)])
        jobs.append((chat_ids(tok, question), rng.randint(16, 128)))
    return jobs


def chat_ids(tok, text: str) -> list[int]:
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok(rendered, add_special_tokens=False)["input_ids"]


def overlap_workloads(model_dir: Path) -> dict[str, list[tuple[list[int], int]]]:
    """Chat requests whose answers repeat their prompts: copying a text, and reformatting a list as JSON."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    copy = [(chat_ids(tok, f"Copy the following text exactly: {COPY_TEXTS[i % 4]} (#{i})"), 64) for i in range(32)]
    people = [(chat_ids(tok, "Rewrite this list as a JSON array of objects with name and age: "
                        f"{COPY_TEXTS[3]} Eve, {20 + i}, chef."), 64) for i in range(32)]
    return {"copy": copy, "list-to-json": people}


def workload(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(10, vocab) for _ in range(rng.randint(8, 64))], rng.randint(16, 128)) for _ in range(n)]


def sampling_kwargs(kind: str) -> dict:
    return {"temperature": 0.0} if kind == "greedy" else {"temperature": 1.0, "top_k": 50, "top_p": 0.95}


def repetitive_workload(n: int, vocab: int, seed: int = 1) -> list[tuple[list[int], int]]:
    """Prompts made of a short random phrase repeated: what prompt lookup is for."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        phrase = [rng.randrange(10, vocab) for _ in range(rng.randint(3, 8))]
        jobs.append(((phrase * 12)[: rng.randint(24, 64)], 128))
    return jobs
