"""Chat messages (OpenAI format) to prompt token ids, with the model's own chat template."""

from __future__ import annotations

from functools import lru_cache
from typing import Any


@lru_cache(maxsize=4)
def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def render_chat(tokenizer: Any, messages: Any, template_kwargs: dict[str, Any] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template: str | None = None) -> list[int]:
    """Token ids of ``messages`` with the generation prompt appended; ValueError names what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        content = message.get("content")
        if isinstance(content, list):  # OpenAI content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ValueError(f"messages[{i}].content: only text parts are supported")
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise ValueError("'chat_template_kwargs' must be an object")
    normalized = [{**m, "content": m["content"] if isinstance(m["content"], str)
                   else "".join(p["text"] for p in m["content"])} for m in messages]
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the model's tokenizer has no chat template; send 'prompt' instead of 'messages'")
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    extra = {"chat_template": chat_template} if chat_template is not None else {}
    if continue_final_message:
        extra["continue_final_message"] = True
    try:
        ids = tokenizer.apply_chat_template(normalized, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            **extra, **(template_kwargs or {}))
    except Exception as exc:
        raise ValueError(f"the chat template could not render these messages: {type(exc).__name__}: {exc}") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
