"""Chat templates: a conversation rendered and tokenized exactly as Hugging Face transformers'
`apply_chat_template` does it, for instruction data (`python -m mamba_jax.data prepare
--format chat`) and the server's `/v1/chat/completions`.

    template = ChatTemplate.from_model_dir("path/to/model")      # None where it has none
    text = template.render(messages, add_generation_prompt=True)
    ids = template.encode(tokenizer, messages, add_generation_prompt=True)
    ids, mask = template.encode_with_mask(tokenizer, messages)   # 1 on the assistant's tokens

A template is a model's Jinja program over `messages` (OpenAI-style dicts: `role`, `content`),
`add_generation_prompt`, `tools`, `documents` and the tokenizer's special tokens (`bos_token`,
`eos_token`, ...). It runs as transformers runs it: jinja2's immutable sandbox with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension and transformers' globals
(`raise_exception`, `strftime_now`, a `tojson` that does not escape HTML) and its
`{% generation %}` tag, which marks the text a fine-tune learns. The rendered text is then
tokenized without adding special tokens (the template writes them). Where a model dir holds
`chat_template.jinja` (and `additional_chat_templates/NAME.jinja`), those files are its
templates, as transformers reads them, before `tokenizer_config.json`'s `chat_template` (a
string, or a list of named templates): "default", and "tool_use" for a conversation with
tools where the model names one. `save` writes a template beside a model's tokenizer as
transformers' save_pretrained does (chat_template.jinja and tokenizer_config.json's special
tokens), so that a fine-tuned model's export and its trainer's checkpoints carry the
template its data was rendered with.
"""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mamba_jax.files import replace_text
from mamba_jax.tokenizer import tokenizer_file_name

# The named special tokens transformers passes to a template (its SPECIAL_TOKENS_ATTRIBUTES).
TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
# The named template transformers renders a conversation with tools with, where a model has
# several (its get_chat_template); and the folder of a model's named templates' files
TOOL_USE = "tool_use"
ADDITIONAL_TEMPLATES = "additional_chat_templates"
# The names a message's reasoning is passed under; templates read the first.
_REASONING = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A template that does not compile or render, or a conversation it refuses; the message
    names the template and the problem."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body and, while `spans` is a list,
    records the body's (start, end) characters in the text rendered so far."""

    tags = {"generation"}

    def __init__(self, environment):
        super().__init__(environment)
        environment.extend(generation_spans=None, rendered_blocks=None)

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller):
        text = caller()
        spans, blocks = self.environment.generation_spans, self.environment.rendered_blocks
        if spans is not None:
            start = sum(len(block) for block in blocks)
            spans.append((start, start + len(text)))
        return text


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.datetime.now().strftime(format)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace() without underscore-prefixed attributes (transformers' sandbox
    rule: they lead to CPython's internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not store the underscore-prefixed attribute {name!r}")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=dict, namespace=_Namespace)
    return env


def _token_text(value) -> str | None:
    """A tokenizer_config.json special token: a string, or an AddedToken's {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _plain(messages, where: str) -> list[dict]:
    """The messages as transformers hands them to a template: dicts of plain JSON values,
    keys whose value is None dropped, reasoning under each of its names."""
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"{where}: messages must be a list of {{role, content}} "
                                f"objects, not {type(messages).__name__}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"{where}: message {i} is a {type(message).__name__}, not "
                                    "an object with role and content")
        try:  # transformers hands a template plain JSON values only
            message = json.loads(json.dumps(message))
        except (TypeError, ValueError) as error:
            raise ChatTemplateError(f"{where}: message {i} holds a value that is not JSON "
                                    f"({error})") from None
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class ChatTemplate:
    """A model's chat template with its special tokens. `source` names where it came from.
    tool_use: the model's template for conversations with tools, where it names one beside
    its default (transformers' get_chat_template renders those with it)."""

    def __init__(self, text: str, special_tokens: dict[str, str] | None = None,
                 source: str = "the chat template", tool_use: str | None = None,
                 tool_use_source: str | None = None):
        self.text, self.source = text, source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(text)
        except jinja2.exceptions.TemplateSyntaxError as error:
            raise ChatTemplateError(f"{source}: not a Jinja template ({error.message}, line "
                                    f"{error.lineno})") from None
        self.tool_use = None if tool_use is None else ChatTemplate(
            tool_use, special_tokens, tool_use_source or f"{source} ({TOOL_USE})")

    @classmethod
    def from_model_dir(cls, directory) -> ChatTemplate | None:
        """The template of a model (or tokenizer) dir, with the special tokens of its
        tokenizer_config.json (and special_tokens_map.json); None where it has no template.
        As transformers reads them: chat_template.jinja ("default") and
        additional_chat_templates/NAME.jinja, else tokenizer_config.json's chat_template (a
        string, or a list of named templates)."""
        directory = Path(directory)
        special = model_special_tokens(directory)
        files = [directory / "chat_template.jinja",
                 *sorted((directory / ADDITIONAL_TEMPLATES).glob("*.jinja"))]
        named = {("default" if path.name == "chat_template.jinja" else path.stem):
                 (path.read_text(encoding="utf-8"), str(path)) for path in files if path.is_file()}
        where = f"{directory / 'tokenizer_config.json'}'s chat_template"
        if not named:  # the files take priority over tokenizer_config.json's
            text = _read_json(directory / "tokenizer_config.json").get("chat_template")
            if isinstance(text, list):
                named = {t.get("name"): (t.get("template"), f"{where} {t.get('name')!r}")
                         for t in text if isinstance(t, dict)}
            elif text is not None:
                named = {"default": (text, where)}
        if not named:
            return None
        if "default" not in named:
            raise ChatTemplateError(f"{where} names templates {sorted(map(str, named))} and "
                                    "no 'default'; give one with --chat-template FILE")
        for text, source in named.values():
            if not isinstance(text, str):
                raise ChatTemplateError(f"{source} is a {type(text).__name__}, not a template")
        text, source = named["default"]
        tool_use, tool_use_source = named.get(TOOL_USE, (None, None))
        return cls(text, special, source, tool_use, tool_use_source)

    @classmethod
    def from_file(cls, path, special_tokens: dict[str, str] | None = None) -> ChatTemplate:
        """A template written in a file of its own (`--chat-template FILE`)."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ChatTemplateError(f"chat template {path}: cannot read it "
                                    f"({getattr(error, 'strerror', None) or error})") from None
        return cls(text, special_tokens, str(path))

    def unnamed_tokens(self) -> list[str]:
        """The special tokens (TEMPLATE_TOKENS) the template writes but its special_tokens
        lack, which render as empty text: e.g. its eos_token where a --chat-template file
        goes with a tokenizer file, whose tokenizer_config.json would name it."""
        read = set().union(*(jinja2.meta.find_undeclared_variables(
            template._template.environment.parse(template.text))
            for template in (self, self.tool_use) if template is not None))
        return [name for name in TEMPLATE_TOKENS if name in read and name not in
                self.special_tokens]

    def save(self, directory, tokenizer) -> None:
        """Write the template beside `tokenizer` (saved in `directory` by
        tokenizer.save_tokenizer) as transformers' save_pretrained does, for from_model_dir and
        transformers' AutoTokenizer to read: chat_template.jinja, and tokenizer_config.json
        with its special tokens and, for a tokenizer.json, the class AutoTokenizer loads
        that with (PreTrainedTokenizerFast)."""
        directory = Path(directory)
        config = {**({"tokenizer_class": "PreTrainedTokenizerFast"}
                     if tokenizer_file_name(tokenizer) == "tokenizer.json" else {}),
                  **self.special_tokens}
        if self.tool_use is None:
            replace_text(directory / "chat_template.jinja", self.text)
        else:  # named, in the config (transformers would read a chat_template.jinja first)
            (directory / "chat_template.jinja").unlink(missing_ok=True)
            config["chat_template"] = [{"name": "default", "template": self.text},
                                       {"name": TOOL_USE, "template": self.tool_use.text}]
        replace_text(directory / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")

    def _chosen(self, kwargs) -> ChatTemplate:
        """The template a conversation renders with: tool_use where it has tools and the
        model names one, else this one (transformers' get_chat_template)."""
        return self.tool_use if self.tool_use and kwargs.get("tools") is not None else self

    def render(self, messages, *, add_generation_prompt: bool = False, **kwargs) -> str:
        """The conversation's text, as apply_chat_template(tokenize=False) renders it."""
        return self._chosen(kwargs)._render(messages, add_generation_prompt, kwargs, None)[0]

    def _render(self, messages, add_generation_prompt, kwargs, spans):
        env = self._template.environment
        context = {**self.special_tokens, **kwargs,
                   "messages": _plain(messages, self.source),
                   "add_generation_prompt": add_generation_prompt}
        context.setdefault("tools", None)
        context.setdefault("documents", None)
        blocks: list[str] = []
        env.generation_spans, env.rendered_blocks = spans, blocks
        try:
            for block in self._template.generate(**context):
                blocks.append(block)
        except jinja2.exceptions.TemplateError as error:  # raise_exception's among them
            raise ChatTemplateError(f"{self.source} does not render this conversation: "
                                    f"{error}") from None
        except (TypeError, KeyError, AttributeError, IndexError, ValueError) as error:
            raise ChatTemplateError(f"{self.source} does not render this conversation: "
                                    f"{type(error).__name__}: {error}") from None
        finally:
            env.generation_spans = env.rendered_blocks = None
        return "".join(blocks), spans

    def encode(self, tokenizer, messages, *, add_generation_prompt: bool = False,
               **kwargs) -> list[int]:
        """The conversation's token ids, as apply_chat_template(tokenize=True) gives them:
        the rendered text tokenized without adding special tokens."""
        text = self.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return list(tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_with_mask(self, tokenizer, messages, **kwargs) -> tuple[list[int], list[int]]:
        """(ids, mask): the conversation's token ids (`encode`) and, per token, 1 where it
        belongs to what a fine-tune learns, else 0.

        Where the template marks that text with `{% generation %}`, the mask is
        transformers' `return_assistant_tokens_mask`: every token overlapping a marked span.
        Elsewhere each assistant message's span is found by rendering the conversation up
        to it twice, with the generation prompt and with the message: the span is what the
        message adds to the prompt, its content and its end of turn. That needs a template
        that renders a conversation's beginning the same whatever follows it; one that does
        not (e.g. one that drops earlier turns' reasoning) is refused, asking for
        `{% generation %}` blocks."""
        if (chosen := self._chosen(kwargs)) is not self:
            return chosen.encode_with_mask(tokenizer, messages, **kwargs)
        messages = _plain(messages, self.source)
        if re.search(r"\{%-?\s*generation\s*-?%\}", self.text):
            text, spans = self._render(messages, False, kwargs, [])
        else:
            text, spans = self.render(messages, **kwargs), []
            for i, message in enumerate(messages):
                if message.get("role") != "assistant":
                    continue
                prompt = self.render(messages[:i], add_generation_prompt=True, **kwargs)
                turn = self.render(messages[:i + 1], **kwargs)
                if not (turn.startswith(prompt) and text.startswith(turn)):
                    raise ChatTemplateError(
                        f"{self.source} renders the conversation's turns before message {i} "
                        "differently once later turns follow, so the assistant's text cannot be "
                        "told apart; mark it with {% generation %}...{% endgeneration %} in the "
                        "template (as transformers' return_assistant_tokens_mask needs), or "
                        "give another with --chat-template FILE")
                spans.append((len(prompt), len(turn)))
        encoding = tokenizer.encode(text, add_special_tokens=False)
        offsets = getattr(encoding, "offsets", None)
        if offsets is None:
            raise ChatTemplateError(f"{self.source}: the tokenizer gives no character offsets, "
                                    "which a loss mask needs; use a tokenizer.json tokenizer")
        return list(encoding.ids), _overlapping(offsets, [s for s in spans if s[1] > s[0]])


def model_special_tokens(directory) -> dict[str, str]:
    """The special tokens of a model (or tokenizer) dir by name (TEMPLATE_TOKENS: "bos_token",
    "eos_token", ...): its tokenizer_config.json's over its special_tokens_map.json's, as
    transformers reads them; {} where it has neither."""
    directory = Path(directory)
    tokens = {**_read_json(directory / "special_tokens_map.json"),
              **_read_json(directory / "tokenizer_config.json")}
    return {name: text for name in TEMPLATE_TOKENS
            if (text := _token_text(tokens.get(name))) is not None}


def _overlapping(offsets, spans) -> list[int]:
    """Per token (its (start, end) characters), 1 where it overlaps one of the spans (sorted,
    disjoint), as transformers masks the tokens of `{% generation %}` spans."""
    mask, k = [0] * len(offsets), 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[i] = 1
    return mask


def _read_json(path: Path) -> dict:
    """A JSON object from path, {} where there is no such file."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise ChatTemplateError(f"{path}: not JSON ({error})") from None
    if not isinstance(value, dict):
        raise ChatTemplateError(f"{path}: a JSON {type(value).__name__}, not an object")
    return value
