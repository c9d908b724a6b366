"""Jinja chat templates, rendered the way Hugging Face transformers renders them.

A model's chat template turns a list of messages (and optional tool schemas) into the prompt text the model
was trained on. :class:`ChatTemplate` compiles a template once in a sandboxed Jinja environment configured
like ``transformers.utils.chat_template_utils`` (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, a
``tojson`` filter that does not escape HTML, the ``raise_exception`` and ``strftime_now`` globals, a no-op
``{% generation %}`` tag) and prepares the inputs the same way, so that the rendered string is identical to
``tokenizer.apply_chat_template(..., tokenize=False)``.

A template comes from a model file, so it is not trusted: it renders in jinja2's immutable sandbox, and one
that reaches for Python internals (``''.__class__.__mro__``, ``cycler.__init__.__globals__``) is refused when
it is loaded, not at the first request: by its source (an attribute or item named with a leading underscore,
which the sandbox never serves) and by rendering a few probe conversations (tools, tool calls, reasoning), in
which any sandbox violation fails the load with :class:`~kvos.errors.UnsafeTemplateError`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvos.errors import TokenizerError, UnsafeTemplateError

if TYPE_CHECKING:
    from kvos.model.tokenizer import Tokenizer

# Names a message's reasoning may come under; transformers copies it to ``reasoning_content`` (which most
# templates read) and to ``thinking`` (which gpt-oss templates read).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> NoReturn:
    """The ``raise_exception`` global: a template's own error, surfaced as a :class:`TokenizerError`."""
    raise TokenizerError(f"chat template error: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """The ``tojson`` filter as transformers defines it: plain ``json.dumps``, no HTML escaping."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    """The ``strftime_now`` global: the local time now, formatted with ``strftime``."""
    return datetime.now().strftime(format)


class _TemplateDict:
    """The ``dict`` global: builds plain dicts without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """The ``namespace`` global: a Jinja namespace that refuses underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja2.utils.Namespace
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace (got {name!r})"
            )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for masks): renders its body."""

    tags = {"generation"}  # noqa: RUF012 -- jinja2's Extension declares it as a plain class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, raising at an unsafe attribute at once (jinja2 gives an undefined that
    prints as nothing), so a template that reaches for one fails where it does, probes included."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


def _environment() -> ImmutableSandboxedEnvironment:
    """A sandboxed environment configured like transformers' chat template environment."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _plain(value: Any) -> Any:
    """A copy of ``value`` made of plain JSON-like types only, as transformers gives templates.

    Mappings become dicts, lists stay lists and tuples tuples, dataclasses and pydantic models become dicts,
    subclasses of str/int/float become the base type, and anything else becomes a ``"<TypeName>"``
    placeholder, so a template never sees (or mutates) the caller's rich objects.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _prepare_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers passes them: ``None`` values dropped, plain types, reasoning aliased."""
    prepared = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TokenizerError(
                f"message {index} is a {type(message).__name__}; pass each message as a dict with 'role' "
                "and 'content'"
            )
        plain = _plain({key: item for key, item in message.items() if item is not None})
        reasoning = next((plain[key] for key in _REASONING_FIELDS if plain.get(key) is not None), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        prepared.append(plain)
    return prepared


_PROBE_TOOL = {"type": "function", "function": {"name": "probe", "parameters": {"type": "object"}}}
_PROBE_CALL = {"id": "call_0", "type": "function", "function": {"name": "probe", "arguments": "{}"}}
# conversations rendered once when a template is loaded, to meet a sandbox violation then, not in a request
PROBES: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": True},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"},
            {"role": "user", "content": "Look it up"},
            {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]},
            {"role": "tool", "content": "{}", "tool_call_id": "call_0", "name": "probe"},
        ],
        "tools": [_PROBE_TOOL],
        "add_generation_prompt": True,
    },
]
_VETTED: set[str] = set()  # sources that passed the probes (a session builds its template again)


def _reaches_for_internals(template: jinja2.nodes.Template) -> str | None:
    """The first attribute or constant item name with a leading underscore in a parsed template (what the
    sandbox refuses to serve: ``__class__``, ``__globals__``, ``_private``), with its line; None if none."""
    for node in template.find_all((jinja2.nodes.Getattr, jinja2.nodes.Getitem, jinja2.nodes.Filter)):
        name: object = None
        if isinstance(node, jinja2.nodes.Getattr):
            name = node.attr
        elif isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
            name = node.arg.value
        elif isinstance(node, jinja2.nodes.Filter) and node.name == "attr" and node.args:  # x|attr("_y")
            first = node.args[0]
            name = first.value if isinstance(first, jinja2.nodes.Const) else None
        if isinstance(name, str) and name.startswith("_"):
            return f"{name!r} at line {node.lineno}"
    return None


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: the Jinja template text (``tokenizer_config.json``'s ``chat_template`` or
            ``chat_template.jinja``).
        bos_token: the tokenizer's BOS token string, visible to the template as ``bos_token``.
        eos_token: the tokenizer's EOS token string, visible as ``eos_token``.
        special_tokens: further named special tokens (e.g. ``{"pad_token": "<pad>"}``), each visible under its
            name; ``bos_token``/``eos_token`` given here are used when the arguments above are ``None``.

    Raises:
        TokenizerError: the template has a Jinja syntax error.
        UnsafeTemplateError: the template reaches for Python internals (see the module's docstring).
    """

    def __init__(
        self,
        source: str,
        bos_token: str | None = None,
        eos_token: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
    ) -> None:
        self.source = source
        named = {name: str(token) for name, token in (special_tokens or {}).items() if token is not None}
        if bos_token is not None:
            named["bos_token"] = bos_token
        if eos_token is not None:
            named["eos_token"] = eos_token
        self.special_tokens: dict[str, str] = named
        env = _environment()
        try:
            parsed = env.parse(source)
            self._template = env.from_string(parsed)
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(
                f"chat template has a syntax error at line {exc.lineno}: {exc.message}; fix the template "
                "(tokenizer_config.json 'chat_template' or chat_template.jinja)"
            ) from exc
        if source not in _VETTED:
            self._vet(parsed)
            _VETTED.add(source)

    def _vet(self, parsed: jinja2.nodes.Template) -> None:
        """Refuse a template that reaches for Python internals: by its source, then by the probes."""
        unsafe = _reaches_for_internals(parsed)
        if unsafe is not None:
            raise UnsafeTemplateError(
                f"chat template reaches for Python internals ({unsafe}); kvos renders templates in a sandbox "
                "and refuses this one: fix or replace the model's chat template"
            )
        for probe in PROBES:
            try:
                self.render(**probe)
            except TokenizerError as exc:
                if isinstance(exc.__cause__, jinja2.exceptions.SecurityError):
                    raise UnsafeTemplateError(
                        f"chat template is unsafe: it failed to render a probe conversation in the sandbox "
                        f"({exc.__cause__}); fix or replace the model's chat template"
                    ) from exc.__cause__
                # any other failure (raise_exception on a shape it refuses, ...) is the template's own

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> ChatTemplate:
        """The chat template of ``tokenizer``, with its BOS/EOS (and other named special) token strings.

        Raises:
            TokenizerError: the tokenizer has no chat template.
        """
        if tokenizer.chat_template is None:
            raise TokenizerError(
                "this tokenizer has no chat template; give the model directory a chat_template.jinja or a "
                "'chat_template' entry in tokenizer_config.json, or build a ChatTemplate from your own source"
            )
        named: Mapping[str, str] = getattr(tokenizer, "named_special_tokens", {})
        return cls(
            tokenizer.chat_template,
            bos_token=getattr(tokenizer, "bos_token", None),
            eos_token=getattr(tokenizer, "eos_token", None),
            special_tokens=named,
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """Render ``messages`` to prompt text.

        Args:
            messages: dicts with at least ``role`` and ``content`` (and e.g. ``tool_calls``,
                ``reasoning_content``); keys whose value is ``None`` are dropped, as transformers does.
            add_generation_prompt: end with the header that starts an assistant turn.
            tools: JSON-schema tool definitions, passed to the template as given (``None`` when absent).
            **extra: further template variables (e.g. ``enable_thinking=False``); they override the
                special tokens.

        Raises:
            TokenizerError: the conversation is empty, a message is not a dict, the template called
                ``raise_exception``, or rendering failed.
        """
        if len(messages) == 0:
            raise TokenizerError("cannot render an empty conversation; pass at least one message")
        context: dict[str, Any] = {"documents": None, **self.special_tokens, **_plain(dict(extra))}
        context["messages"] = _prepare_messages(messages)
        context["tools"] = None if tools is None else _plain(list(tools))
        context["add_generation_prompt"] = add_generation_prompt
        try:
            return self._template.render(context)
        except TokenizerError:
            raise
        except Exception as exc:
            raise TokenizerError(
                f"chat template failed to render: {type(exc).__name__}: {exc}; check that the messages have "
                "the fields this template expects"
            ) from exc
