"""A chat template given in place of the tokenizer's (vLLM's `--chat-template`):
a Jinja file, or the template's own text."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
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


@dataclass(frozen=True)
class TemplateTraits:
    """What a chat template expects of the messages it renders (vLLM's detection):
    `parts`: it loops over a message's content, so content goes to it as a list of
    {"type": "text", "text": ...} parts (OpenAI's format) rather than one string;
    `developer`: it names the developer role (elsewhere developer messages render
    as system ones)."""

    parts: bool = False
    developer: bool = False


@lru_cache(maxsize=32)
def template_traits(template: str | None) -> TemplateTraits:
    """The traits of `template` (a Jinja text; anything else, or a template Jinja
    cannot parse, renders as plain strings)."""
    if not isinstance(template, str):
        return TemplateTraits()
    developer = '"developer"' in template or "'developer'" in template
    try:      # parsed as transformers compiles it (its {% generation %} tag, loop controls)
        from transformers.utils.chat_template_utils import _compile_jinja_template
        tree = _compile_jinja_template(template).environment.parse(template)
    except Exception:  # noqa: BLE001 - a template that does not parse fails at rendering, with its message
        return TemplateTraits(False, developer)
    return TemplateTraits(_loops_over_content(tree), developer)


def _loops_over_content(tree) -> bool:
    """Whether a `for` of the template iterates over a message's content: a loop over
    `m.content` / `m['content']` (filtered, tested or sliced too) where `m` is a loop
    variable over the messages (or over a name assigned from them), or over a name
    `content` itself."""
    from jinja2 import nodes

    def accessed(node, names: set[str], key: str | None = None) -> bool:
        """`node` reads one of `names` (its `key` item or attribute, when given)."""
        while isinstance(node, (nodes.Filter, nodes.Test)) or \
                (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
            node = node.node
            if node is None:
                return False
        if key is None:
            return isinstance(node, nodes.Name) and node.name in names
        if isinstance(node, nodes.Getitem):
            return isinstance(node.arg, nodes.Const) and node.arg.value == key and accessed(node.node, names)
        return isinstance(node, nodes.Getattr) and node.attr == key and accessed(node.node, names)

    messages = {"messages"}          # and every name assigned from them ({% set loop_messages = messages[1:] %})
    grew = True
    while grew:
        assigned = {a.target.name for a in tree.find_all(nodes.Assign)
                    if isinstance(a.target, nodes.Name) and accessed(a.node, messages)}
        grew = not assigned <= messages
        messages |= assigned
    message_vars = {f.target.name for f in tree.find_all(nodes.For)
                    if isinstance(f.target, nodes.Name) and accessed(f.iter, messages)}
    return any(accessed(f.iter, message_vars, "content") or accessed(f.iter, {"content"})
               for f in tree.find_all(nodes.For))
