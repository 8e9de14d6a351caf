"""The facts a run reads once cross process boundaries whole, and a coordinator in another process
gets the driver's tokenizer without importing transformers' model-loading code."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

from cluster.config import resolve
from cluster.engine.setup import load_tokenizer, shippable_tokenizer

ROOT = Path(__file__).resolve().parents[3]
TEXTS = ["The capital of France is", "café 你好 <|im_end|> tail", "  two  spaces\tand a tab\n", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]


def tokenizer_facts(tokenizer) -> dict:
    """What the coordinator uses a tokenizer for, on text that exercises added and special tokens."""
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in TEXTS]
    return {"ids": ids, "decoded": [tokenizer.decode(i) for i in ids],
            "chat": tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
            "special": [tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id],
            "vocab": len(tokenizer), "class": type(tokenizer).__name__}


def test_a_coordinator_process_gets_the_drivers_tokenizer_and_facts_without_the_model_config_class(tmp_path):
    config = resolve(ROOT / "configs" / "default.yaml")
    shipped = tmp_path / "shipped.pkl"
    shipped.write_bytes(pickle.dumps((config, shippable_tokenizer(config.facts))))
    script = f"""
import json, pickle, sys
from cluster.engine.setup import coordinator_inputs
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_model_facts import tokenizer_facts
config, tokenizer = pickle.loads(open({str(shipped)!r}, "rb").read())
tokenizer, model = coordinator_inputs(config, tokenizer)
loaded = [m for m in ("transformers.core_model_loading", "transformers.models.llama.configuration_llama")
          if m in sys.modules]
print(json.dumps({{"facts": tokenizer_facts(tokenizer), "vocab_size": model.vocab_size,
                   "max_model_len": model.max_model_len, "loaded": loaded}}))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    there = json.loads(done.stdout.strip().splitlines()[-1])
    assert there["loaded"] == []  # the coordinator never imported the config's class
    here = json.loads(json.dumps(tokenizer_facts(load_tokenizer(config.facts))))  # tuples as lists
    assert there["facts"] == here
    assert there["vocab_size"] == config.facts.hf_config.vocab_size and there["max_model_len"] == 1024


def test_the_config_read_after_a_round_trip_is_the_one_read_at_the_start():
    facts = resolve(ROOT / "configs" / "default.yaml").facts
    again = pickle.loads(pickle.dumps(facts))
    assert isinstance(again._config, bytes)  # not unpickled until read
    assert type(again.hf_config) is type(facts.hf_config)
    assert again.hf_config.to_dict() == facts.hf_config.to_dict()
    assert (again.path, again.vocab_size, again.max_model_len, again.generation_eos) == \
        (facts.path, facts.vocab_size, facts.max_model_len, facts.generation_eos)
