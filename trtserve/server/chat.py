"""Chat messages to a prompt with the tokenizer's own chat template (or --chat-template), rendered in the
environment transformers' `apply_chat_template` gives a template, without transformers: a sandbox with
trim_blocks and lstrip_blocks, the loop controls (`break`, `continue`), the `{% generation %}` tag (rendered
as its body), `raise_exception`, `strftime_now`, a `tojson` that does not escape HTML, `dict` and a
`namespace` that refuses underscore names; the tokenizer's special tokens, `tools`, `documents` and the
request's `chat_template_kwargs` as variables; `continue_final_message` cut where the last message ends."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from trtserve.runtime.text import SpecialTokens
from trtserve.server.errors import BadRequest

ROLES = ("system", "developer", "user", "assistant", "tool")
RESERVED = ("messages", "tools", "documents", "add_generation_prompt")  # set by the server, not by kwargs
_CUT = "\u2063TRTSERVE-END-OF-FINAL-MESSAGE\u2063"  # marks where a continued final message ends


def load_chat_template(engine_path: Path) -> str | None:
    path = Path(engine_path)
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    config = path / "tokenizer_config.json"
    template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    if isinstance(template, list):  # named templates: use "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def template_option(value: str | None) -> str | None:
    """--chat-template: a file's path (read here), or the template itself."""
    if not value:
        return None
    try:
        is_file = Path(value).is_file()
    except (OSError, ValueError):  # a template's text is no path (too long a name, a NUL)
        is_file = False
    try:
        return Path(value).read_text(encoding="utf-8") if is_file else value
    except (OSError, UnicodeDecodeError) as exc:
        from trtserve.errors import TrtServeError

        raise TrtServeError(f"--chat-template {value}: {exc}") from None


def _environment():
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's part for training masks; here its
        body is rendered as it is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """jinja's namespace, refusing attribute names that start with an underscore."""

        def __init__(*args, **kwargs):
            for name in dict(*args[1:], **kwargs):
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(*args, **kwargs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")

    class Dicts:
        """`dict(...)` and `dict.fromkeys(...)`, and nothing else of the type."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=Dicts(), namespace=Namespace)
    return env


class ChatRenderer:
    def __init__(self, template: str, special: dict[str, object] | None = None, **tokens: str):
        """`special` (and `tokens`, one by one): the tokenizer's special tokens as template variables
        (bos_token, eos_token, ...)."""
        from jinja2.exceptions import TemplateSyntaxError

        try:
            self.template = _environment().from_string(template)
        except TemplateSyntaxError as exc:
            from trtserve.errors import TrtServeError

            raise TrtServeError(f"the chat template does not parse: {exc} (line {exc.lineno})") from None
        self.takes_tools = "tools" in template  # the template renders tool definitions itself
        self.reads_content = "content" in template  # a final message can be continued (as transformers checks)
        self.special = {**(special or {}), **tokens}

    @classmethod
    def for_engine(cls, engine_path: Path, special: SpecialTokens, template: str | None = None) -> ChatRenderer | None:
        """The engine's own template, or `template` (--chat-template) instead."""
        template = template or load_chat_template(engine_path)
        if not template:
            return None
        return cls(template, special_tokens_map(engine_path, special))

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
               continue_final_message: bool = False, kwargs: dict | None = None) -> str:
        from jinja2.exceptions import TemplateError

        if not messages:
            raise BadRequest("`messages` is empty: give at least one message", param="messages")
        for i, message in enumerate(messages):
            if message["role"] not in ROLES:
                raise BadRequest(f"messages[{i}].role is {message['role']!r}; use one of {', '.join(ROLES)}",
                                 param=f"messages.{i}.role")
        clash = next((key for key in (kwargs or {}) if key in RESERVED), None)
        if clash is not None:
            raise BadRequest(f"chat_template_kwargs.{clash} is set by the request itself: give `{clash}` there",
                             param=f"chat_template_kwargs.{clash}")
        # "developer" is OpenAI's newer name for "system"; templates know "system"
        messages = [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in messages]
        final = ""
        if continue_final_message:
            if not self.reads_content:
                raise BadRequest("continue_final_message: the chat template never reads a message's content",
                                 param="continue_final_message")
            final = messages[-1].get("content") or ""
            if not isinstance(final, str):
                raise BadRequest("continue_final_message needs a final message with text content", param="messages")
            messages[-1] = {**messages[-1], "content": final + _CUT}
        try:
            text = self.template.render(**{**self.special, **(kwargs or {})}, messages=messages, tools=tools or None,
                                        documents=None, add_generation_prompt=add_generation_prompt)
        except TemplateError as exc:
            raise BadRequest(f"the model's chat template refused these messages: {exc}", param="messages") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:  # values the template cannot take
            raise BadRequest(f"the model's chat template failed on this request: {type(exc).__name__}: {exc}",
                             param="chat_template_kwargs" if kwargs else "messages") from None
        if continue_final_message:
            if _CUT not in text:
                raise BadRequest("continue_final_message: the chat template does not keep the final message whole, "
                                 "so it cannot be continued", param="continue_final_message")
            text = text[:text.rindex(_CUT)]
        return text


def special_tokens_map(engine_path: Path, special: SpecialTokens) -> dict[str, object]:
    """The template variables transformers gives from the tokenizer's special tokens map."""
    path = Path(engine_path) / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    found: dict[str, object] = {"bos_token": special.bos_token, "eos_token": special.eos_token}
    for key in ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            found[key] = value
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens")
    if isinstance(extra, list):
        found["additional_special_tokens"] = [t.get("content") if isinstance(t, dict) else t for t in extra]
    return found
