"""Chat messages (OpenAI format) to prompt token ids, with the model's own chat template."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

# Seconds a chat template may take to render one request's messages (where rendering runs in the
# main thread: the batch job's input lines). The model's template is trusted code, but its work
# grows with what a line sends.
RENDER_LIMIT_S = 10.0


class RenderTimeout(ValueError):
    """Rendering one request's messages took longer than allowed."""


# Options of the tokenizer's call (``apply_chat_template``), not variables of the template:
# ``padding``/``max_length`` from one line took a job to 19 GiB, ``truncation`` cut a prompt silently.
# ``chat_template_kwargs`` reach the template only (as vLLM passes them); these are refused by name,
# as is any other named parameter of the tokenizer's ``apply_chat_template``.
TOKENIZER_CALL_OPTIONS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "sanitize_control_tokens", "processor_kwargs",
})


@lru_cache(maxsize=16)
def tokenizer_call_options(tokenizer_type: type) -> frozenset[str]:
    """The fixed set and the named parameters of this tokenizer class's ``apply_chat_template`` (remote
    code may add some); once per class, not per line."""
    import inspect

    try:
        named = {name for name, p in inspect.signature(tokenizer_type.apply_chat_template).parameters.items()
                 if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and name != "self"}
    except (TypeError, ValueError, AttributeError):
        named = set()
    return TOKENIZER_CALL_OPTIONS | named


def request_template_kwargs(value: Any) -> dict[str, Any] | None:
    """``chat_template_kwargs`` sent with a request (an input line, a run-batch body): an object of
    template variables; never a template of its own, which is code (vLLM refuses both spellings too)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("'chat_template_kwargs' must be an object")
    if "chat_template" in value:
        raise ValueError("chat_template_kwargs.chat_template is not allowed: a request cannot bring its own chat "
                         "template (a template is code); the model's template renders 'messages'")
    return value


def check_template_kwargs(template_kwargs: dict[str, Any], tokenizer: Any) -> None:
    """ValueError naming the first key that is an option of the tokenizer's call, not a template variable."""
    options = tokenizer_call_options(type(tokenizer))
    for name in sorted(template_kwargs):
        if name in options:
            raise ValueError(f"chat_template_kwargs.{name} is not allowed: it is an option of the tokenizer's call, "
                             "not a variable of the chat template (chat_template_kwargs reach the template only)")


@contextmanager
def time_limit(seconds: float | None, what: str) -> Iterator[None]:
    """Raise ``RenderTimeout`` inside the block once ``seconds`` pass (main thread only; elsewhere no limit)."""
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expired(signum: int, frame: Any) -> None:
        raise RenderTimeout(f"{what} took more than {seconds:g}s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@lru_cache(maxsize=4)
def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def render_chat(tokenizer: Any, messages: Any, template_kwargs: dict[str, Any] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template: str | None = None, max_chars: int | None = None,
                time_limit_s: float | None = None) -> list[int]:
    """Token ids of ``messages`` with the generation prompt appended; ValueError names what is wrong.

    ``max_chars``: refuse, before rendering, messages whose text is longer than any prompt that fits
    (``coordinator.intake.prompt_limits``); ``time_limit_s``: bound the rendering (``time_limit``)."""
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
    if template_kwargs:
        check_template_kwargs(template_kwargs, tokenizer)
    normalized = [{**m, "content": m["content"] if isinstance(m["content"], str)
                   else "".join(p["text"] for p in m["content"])} for m in messages]
    chars = sum(len(m["content"]) for m in normalized)
    if max_chars is not None and chars > max_chars:
        raise ValueError(f"'messages' hold {chars} characters: more than fit in max_model_len tokens (at most "
                         f"{max_chars} for this tokenizer); refused before rendering")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the model's tokenizer has no chat template; send 'prompt' instead of 'messages'")
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    extra = {"chat_template": chat_template} if chat_template is not None else {}
    if continue_final_message:
        extra["continue_final_message"] = True
    try:
        with time_limit(time_limit_s, "rendering the chat template"):
            # Rendered to text, then tokenized here with fixed options (as apply_chat_template's own
            # tokenize=True does: no special tokens added, the template has them): nothing a request
            # sends reaches the tokenizer's call.
            text = tokenizer.apply_chat_template(normalized, add_generation_prompt=add_generation_prompt,
                                                 tokenize=False, **extra, **(template_kwargs or {}))
    except RenderTimeout as exc:
        raise ValueError(f"the chat template could not render these messages: {exc}") from None
    except Exception as exc:
        raise ValueError(f"the chat template could not render these messages: {type(exc).__name__}: {exc}") from None
    if not isinstance(text, str):
        raise ValueError(f"the chat template rendered {type(text).__name__}, not text")
    if max_chars is not None and len(text) > max_chars:
        raise ValueError(f"the chat template rendered {len(text)} characters: more than fit in max_model_len tokens "
                         f"(at most {max_chars} for this tokenizer); refused before tokenizing")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
