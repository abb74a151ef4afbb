"""Chat messages to prompt text: the tokenizer's chat template, or a documented default.

Templates are Jinja2 (as in transformers' `apply_chat_template`) and come from checkpoint files,
so they run in a sandboxed, immutable environment: a template can format text but cannot reach
Python objects, files or the network.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from serving.errors import invalid

DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""Used when the checkpoint has no chat_template: each message as `<|role|>\\ncontent\\n`, then
`<|assistant|>\\n` to ask for the reply."""


def _raise(message: str) -> None:
    raise TemplateError(message)


@lru_cache(maxsize=16)
def _compile(source: str):
    # the options transformers uses, so a template renders here as it does there
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    return env.from_string(source)


FIXED_VARIABLES = {
    "messages": "the conversation is the request's `messages`",
    "bos_token": "it is the model's own token (tokenizer_config.json)",
    "eos_token": "it is the model's own token (tokenizer_config.json)",
    "raise_exception": "it is the function templates call to refuse input",
}
"""Template variables a request's chat_template_kwargs may not set, and why. add_generation_prompt
may be set there (as in vLLM, whose kwargs update the template's variables)."""


def check_template_kwargs(kwargs: dict[str, Any], param: str = "chat_template_kwargs") -> None:
    """A 400 naming `param.<key>` for a key of FIXED_VARIABLES."""
    for key in kwargs:
        if key in FIXED_VARIABLES:
            raise invalid(f"{param}.{key}: cannot be set ({FIXED_VARIABLES[key]})", f"{param}.{key}")


def render_chat(messages: list[dict], template: str | None, add_generation_prompt: bool = True,
                bos_token: str | None = None, eos_token: str | None = None,
                variables: dict[str, Any] | None = None) -> str:
    """The prompt text of `messages` (dicts with role and content); a template error is a 400.

    `variables` (chat_template_kwargs, tools) are one dict rather than keyword arguments, so that a
    client's key named like a parameter here cannot collide with it; the fixed variables win."""
    variables = {**(variables or {}), "messages": messages, "add_generation_prompt": add_generation_prompt,
                 "bos_token": bos_token or "", "eos_token": eos_token or ""}
    try:
        return _compile(template or DEFAULT_CHAT_TEMPLATE).render(**variables)
    except TemplateError as exc:
        raise invalid(f"messages: the model's chat template rejected them: {exc}", "messages") from None
    except Exception as exc:  # noqa: BLE001 - a template bug must not become a 500 for this request
        raise invalid(f"messages: the chat template failed: {type(exc).__name__}: {exc}", "messages") from None
