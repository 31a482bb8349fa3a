"""A chat template given in place of the tokenizer's (vLLM's `--chat-template`):
a Jinja file, or the template's own text."""

from __future__ import annotations

from pathlib import Path

# what only a Jinja template holds: a string with neither is taken for a file's path
_JINJA_MARKS = ("{{", "{%")


class ChatTemplateError(ValueError):
    """The chat template cannot be used; the message says what to change."""


def read_chat_template(value: str) -> str:
    """The template `value` names: the text of the file at that path, or `value`
    itself where it is a template. Raises ChatTemplateError for a path that names
    no readable file, or a template Jinja cannot parse."""
    path = Path(value).expanduser()
    if any(mark in value for mark in _JINJA_MARKS) and not _is_file(path):
        check_chat_template(value, where="the template given")
        return value
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"chat_template {value}: no readable Jinja file there ({exc}); give the "
                                "path of the template file, or the template itself") from None
    check_chat_template(text, where=str(path))
    return text


def check_chat_template(text: str, where: str = "the template") -> None:
    """Raises ChatTemplateError unless `text` parses as a Jinja template."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat_template ({where}) is not a valid Jinja template: {exc.message} "
                                f"(line {exc.lineno})") from None


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:     # a template's text is no path: too long a name, say
        return False
