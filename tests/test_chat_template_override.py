"""A deployment's own chat template (vLLM's --chat-template): read from a file or
given inline, checked before deploying, and what the router renders chats with."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from cluster.cli.main import build_parser
from cluster.cli.serve_command import autoscaled_application, config_from_args
from engine.chat_template import ChatTemplateError, read_chat_template
from router.backend import ModelInfo
from router.metrics import ServingMetrics
from router.openai_api import build_openai_app
from tests.test_openai_api import CHAT, MAX_MODEL_LEN, MODEL, FakeBackend

BRACKETS = ("{% for m in messages %}[{{ m.role }}: {{ m.content }}]{% endfor %}"
            "{% if add_generation_prompt %}>{% endif %}")


def test_a_template_is_read_from_its_file_or_taken_as_given(tmp_path):
    f = tmp_path / "brackets.jinja"
    f.write_text(BRACKETS)
    assert read_chat_template(str(f)) == read_chat_template(BRACKETS) == BRACKETS
    with pytest.raises(ChatTemplateError, match="no readable Jinja file there"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ChatTemplateError, match=r"not a valid Jinja template: .*\(line 1\)"):
        read_chat_template("{% for m in messages %}")
    (tmp_path / "broken.jinja").write_text("hello {{ oops }")
    with pytest.raises(ChatTemplateError, match="broken.jinja"):
        read_chat_template(str(tmp_path / "broken.jinja"))


def test_the_router_renders_chats_with_the_deployments_template(tokenizer):
    class Templated(FakeBackend):
        def model_info(self):
            return ModelInfo(MODEL, MAX_MODEL_LEN, self.vocab_size, chat_template=BRACKETS)
    backend = Templated(tokenizer, len(tokenizer))
    with TestClient(build_openai_app(backend, tokenizer, ServingMetrics())) as client:
        sent = client.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert sent.status_code == 200, sent.text
    assert tokenizer.decode(backend.calls[0][1]) == "[user: hi]>"
    assert tokenizer.chat_template != BRACKETS         # the caller's tokenizer is left as it was


def test_pdserve_serve_takes_it_and_ships_its_text(tmp_path):
    f = tmp_path / "brackets.jinja"
    f.write_text(BRACKETS)
    config = config_from_args(build_parser().parse_args(["serve", "--chat-template", str(f)]))
    assert config.model.chat_template == str(f)
    # an autoscaled application is built in the cluster, where the file may not be: it carries the text
    autoscaled = config_from_args(build_parser().parse_args(
        ["serve", "--chat-template", str(f), "--autoscale", "--slo", "ttft:1000", "tpot:100", "--max-replicas", "3"]))
    shipped = autoscaled_application(autoscaled)["args"]["config_json"]
    assert shipped["model"]["chat_template"] == BRACKETS


@pytest.fixture(scope="module")
def tokenizer():
    from engine.tiny_model import ensure_default_model
    from engine.tokenizer import load_tokenizer
    return load_tokenizer(ensure_default_model())


@pytest.mark.parametrize("template, parts", [
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", False),
    ("{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}", True),
    ("{% for m in messages %}{% for p in m.content | selectattr('type', 'eq', 'text') %}{{ p.text }}"
     "{% endfor %}{% endfor %}", True),
    # a name assigned from the messages (Llama 3.2 Vision's loop_messages), content under another name
    ("{% set loop_messages = messages[1:] %}{% for message in loop_messages %}{% set content = message.content %}"
     "{% for item in content %}{{ item.text }}{% endfor %}{% endfor %}", True),
    # a loop over something else's content is no loop over a message's
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}{% for t in tools %}{% for x in t['content'] %}"
     "{% endfor %}{% endfor %}", False),
    ("{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}", False),
    ("{% for m in messages %", False),          # does not parse: rendering says why
])
def test_template_traits_find_a_loop_over_a_messages_content(template, parts):
    from engine.chat_template import template_traits
    assert template_traits(template).parts is parts
    assert template_traits(template).developer is False
    assert template_traits("{% if m['role'] == 'developer' %}{% endif %}").developer is True
