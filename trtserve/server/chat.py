"""Chat messages to a prompt with the tokenizer's own chat template (Jinja, rendered the way
transformers renders it: sandboxed, trim_blocks, lstrip_blocks), without transformers."""

from __future__ import annotations

import json
from pathlib import Path

from trtserve.runtime.text import SpecialTokens
from trtserve.server.errors import BadRequest

ROLES = ("system", "developer", "user", "assistant", "tool")


def load_chat_template(engine_path: Path) -> str | None:
    path = Path(engine_path)
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    config = path / "tokenizer_config.json"
    template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    if isinstance(template, list):  # named templates: use "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


class ChatRenderer:
    def __init__(self, template: str, bos_token: str = "", eos_token: str = ""):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(template)
        self.takes_tools = "tools" in template  # the template renders tool definitions itself
        self.special = {"bos_token": bos_token, "eos_token": eos_token}

    @classmethod
    def for_engine(cls, engine_path: Path, special: SpecialTokens) -> "ChatRenderer | None":
        template = load_chat_template(engine_path)
        if not template:
            return None
        return cls(template, special.bos_token, special.eos_token)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None) -> str:
        from jinja2.exceptions import TemplateError

        if not messages:
            raise BadRequest("`messages` is empty: give at least one message", param="messages")
        for i, message in enumerate(messages):
            if message["role"] not in ROLES:
                raise BadRequest(f"messages[{i}].role is {message['role']!r}; use one of {', '.join(ROLES)}",
                                 param=f"messages.{i}.role")
        # "developer" is OpenAI's newer name for "system"; templates know "system"
        messages = [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in messages]
        try:
            extra = {"tools": tools} if tools else {}
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special, **extra)
        except TemplateError as exc:
            raise BadRequest(f"the model's chat template refused these messages: {exc}", param="messages") from None
