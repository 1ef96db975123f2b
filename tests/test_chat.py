"""mamba_jax.chat renders and tokenizes chats as transformers' apply_chat_template does
(tests/fixtures/chat, made by tests/fixtures/make_chat_fixtures.py with transformers), and
masks what a fine-tune learns."""

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from mamba_jax.chat import ChatTemplate, ChatTemplateError

FIXTURES = Path(__file__).parent / "fixtures" / "chat"
TEMPLATES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())


def _cases(name):
    return json.loads((FIXTURES / name / "expected.json").read_text(encoding="utf-8"))["cases"]


@pytest.mark.parametrize("name", TEMPLATES)
def test_renders_and_tokenizes_as_transformers(name):
    template = ChatTemplate.from_model_dir(FIXTURES / name)
    tokenizer = Tokenizer.from_file(str(FIXTURES / name / "tokenizer.json"))
    cases = _cases(name)
    assert len(cases) >= 10
    for case in cases:
        kwargs = dict(add_generation_prompt=case["add_generation_prompt"], tools=case["tools"])
        if "error" in case:  # transformers' TemplateError from the template's raise_exception
            with pytest.raises(ChatTemplateError, match=case["error"].split(": ", 1)[1]):
                template.render(case["messages"], **kwargs)
            continue
        assert template.render(case["messages"], **kwargs) == case["text"]
        assert template.encode(tokenizer, case["messages"], **kwargs) == case["ids"]
        if "assistant_masks" in case and not case["add_generation_prompt"]:
            ids, mask = template.encode_with_mask(tokenizer, case["messages"], tools=case["tools"])
            assert (ids, mask) == (case["ids"], case["assistant_masks"])


def test_mask_without_generation_blocks_covers_each_assistant_turn_and_its_end():
    """A template without {% generation %}: each assistant message's span is what it adds
    to the generation prompt, its content and its end of turn; the rest is 0."""
    template = ChatTemplate.from_model_dir(FIXTURES / "chatml")
    tokenizer = Tokenizer.from_file(str(FIXTURES / "chatml" / "tokenizer.json"))
    messages = [{"role": "user", "content": "Hello there"},
                {"role": "assistant", "content": "General Kenobi."},
                {"role": "user", "content": "Again"},
                {"role": "assistant", "content": "Kenobi!"}]
    ids, mask = template.encode_with_mask(tokenizer, messages)
    assert ids == template.encode(tokenizer, messages)
    learned = [[]]
    for token, counted in zip(ids, mask):
        if counted:
            learned[-1].append(token)
        elif learned[-1]:
            learned.append([])
    assert [tokenizer.decode(t, skip_special_tokens=False) for t in learned if t] == \
        ["General Kenobi.<|im_end|>\n", "Kenobi!<|im_end|>\n"]


def test_mask_refused_where_later_turns_change_earlier_ones():
    """A template that drops an earlier turn's reasoning once another assistant turn follows
    cannot be split into turns by rendering: refused, asking for {% generation %}."""
    template = ChatTemplate.from_model_dir(FIXTURES / "reasoning")
    tokenizer = Tokenizer.from_file(str(FIXTURES / "reasoning" / "tokenizer.json"))
    messages = [{"role": "user", "content": "a"},
                {"role": "assistant", "content": "b", "reasoning_content": "because"},
                {"role": "user", "content": "c"},
                {"role": "assistant", "content": "d"}]
    with pytest.raises(ChatTemplateError, match="generation"):
        template.encode_with_mask(tokenizer, messages)


def test_template_sources_and_their_errors(tmp_path):
    """chat_template.jinja wins over tokenizer_config.json's; named templates use "default";
    a dir without one has none; a broken template or config is one ChatTemplateError."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "chat_template": [
            {"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}D"}]}))
    assert ChatTemplate.from_model_dir(tmp_path).render([]) == "<s>D"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert ChatTemplate.from_model_dir(tmp_path).render([{"role": "user", "content": "x"}]) == "J1"
    assert ChatTemplate.from_model_dir(tmp_path / "nothing") is None
    with pytest.raises(ChatTemplateError, match="not a Jinja template"):
        ChatTemplate("{% for %}")
    with pytest.raises(ChatTemplateError, match="message 0 is a str"):
        ChatTemplate("x").render(["hello"])
    with pytest.raises(ChatTemplateError, match="underscore"):  # transformers' sandbox rule
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([])
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}]}))
    with pytest.raises(ChatTemplateError, match="no 'default'"):
        ChatTemplate.from_model_dir(tmp_path)


def test_a_conversation_with_tools_renders_with_the_models_tool_use_template(tmp_path):
    """As transformers' get_chat_template (checked by hand with transformers 5.24): a model
    naming a "tool_use" template beside its default renders a conversation with tools with
    it (every one rendered with the default), named in tokenizer_config.json or as
    additional_chat_templates/tool_use.jinja; save keeps both, as a list in the config."""
    chat, tools = [{"role": "user", "content": "x"}], [{"type": "function",
                                                       "function": {"name": "f"}}]
    listed, files, saved = (tmp_path / name for name in ("listed", "files", "saved"))
    (files / "additional_chat_templates").mkdir(parents=True)
    listed.mkdir()
    saved.mkdir()
    (listed / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "D"},
        {"name": "tool_use", "template": "T{{ tools | length }}"}]}))
    (files / "chat_template.jinja").write_text("D")
    (files / "additional_chat_templates" / "tool_use.jinja").write_text("T{{ tools | length }}")
    ChatTemplate.from_model_dir(listed).save(
        saved, Tokenizer.from_file(str(FIXTURES / "chatml" / "tokenizer.json")))
    for folder in (listed, files, saved):
        template = ChatTemplate.from_model_dir(folder)
        assert (template.render(chat), template.render(chat, tools=tools)) == ("D", "T1")
