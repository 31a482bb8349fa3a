"""A chat template given in place of the tokenizer's (vLLM's `--chat-template`):
a Jinja file, or the template's own text."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

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


def template_traits(template: object) -> TemplateTraits:
    """The traits of `template` (a Jinja text; anything else, or a template Jinja
    cannot parse, renders as plain strings)."""
    return _traits(template) if isinstance(template, str) else TemplateTraits()


def tokenizer_template(tokenizer: Any) -> str | None:
    """The template the tokenizer renders a chat with: its own, or the "default" one
    of the named templates some checkpoints ship (transformers' choice); None where
    it has none it would use."""
    try:
        return tokenizer.get_chat_template()
    except Exception:  # noqa: BLE001 - no template, or named ones without a default: rendering says so
        template = getattr(tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None


@lru_cache(maxsize=32)
def _traits(template: str) -> TemplateTraits:
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


def _template_arguments() -> frozenset[str]:
    """apply_chat_template's own arguments, not for a request's chat_template_kwargs to set:
    those this code knows of, and whatever the installed transformers adds (5.x's
    sanitize_control_tokens switches the tokenizer's shared encoder state)."""
    import inspect

    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    known = {"conversation", "conversations", "tools", "documents", "chat_template", "add_generation_prompt",
             "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
             "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
    parameters = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    return frozenset(known | {name for name, p in parameters.items()
                              if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD})


TEMPLATE_ARGUMENTS = _template_arguments()


# content part types taken as text, and the field that holds their text (an assistant's refusal: vLLM's)
TEXT_PARTS = {"text": "text", "refusal": "refusal"}


def part_text(part: object) -> object:
    """A text or refusal content part's text (anything else: None)."""
    return part.get(TEXT_PARTS[part["type"]]) if is_text_part(part) else None


def is_text_part(part: object) -> bool:
    """A dict whose "type" names a text part (a list or dict there is no part type)."""
    return isinstance(part, dict) and isinstance(part.get("type"), str) and part["type"] in TEXT_PARTS


def template_messages(messages: Sequence[Mapping[str, Any]], traits: TemplateTraits, *,
                      continue_final: bool = False) -> list[dict[str, Any]]:
    """OpenAI-style messages as a template of `traits` takes them (vLLM's rendering):
    content (a string, text parts, or none) as one string with the parts joined by
    newlines, or as a list of {"type": "text"} parts for a template that loops over
    it; an assistant's `reasoning` also as `reasoning_content`; developer messages
    as system ones, merged with the system messages at the front, unless the
    template names the developer role (`continue_final`: the last message, which
    the reply continues, stays last). Other keys pass through. ValueError for
    content that is not text."""
    rendered = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if content is None:
            texts = []
        elif isinstance(content, str):
            texts = [content]
        elif isinstance(content, list) and all(isinstance(part_text(p), str) for p in content):
            texts = [part_text(p) for p in content]
        else:
            raise ValueError(f"message {i}: content must be a string or a list of text parts "
                             "({\"type\": \"text\", \"text\": ...}); other kinds of content are not supported")
        one = {**message, "content": [{"type": "text", "text": t} for t in texts] if traits.parts
               else "\n".join(texts)}
        if one.get("reasoning") is not None and one.get("role") == "assistant":
            one["reasoning_content"] = one["reasoning"]
        rendered.append(one)
    if traits.developer or not any(m.get("role") == "developer" for m in rendered):
        return rendered
    last = []
    if continue_final:
        final = rendered.pop()
        last = [{**final, "role": "system"} if final.get("role") == "developer" else final]
    system = [m for m in rendered if m.get("role") in ("system", "developer")]
    texts = [t for t in (_joined(m["content"]) for m in system) if t]
    merged = [{"role": "system", "content": [{"type": "text", "text": "\n\n".join(texts)}] if traits.parts
               else "\n\n".join(texts)}] if system else []
    return merged + [m for m in rendered if m.get("role") not in ("system", "developer")] + last


def _joined(content: str | list[dict[str, str]]) -> str:
    return content if isinstance(content, str) else "\n".join(part["text"] for part in content)
