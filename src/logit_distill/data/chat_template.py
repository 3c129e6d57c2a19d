"""Chat templates, found and rendered as transformers' ``apply_chat_template`` does.

Where the template comes from (the first that exists): the file given as the `chat_template`
option; ``chat_template.jinja`` next to ``tokenizer.json``; the ``chat_template`` entry of
``tokenizer_config.json`` (a string, or a list of ``{"name", "template"}`` of which ``default`` is
used). transformers reads them in the same order of precedence.

Rendering uses jinja2's ``ImmutableSandboxedEnvironment`` (its decisions, taken faster:
``ChatSandbox``) with the environment of transformers 5 (``utils/chat_template_utils.py``):
``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols`` extension (``{% break %}``,
``{% continue %}``), a ``{% generation %}`` block tag recording where the assistant's text lies,
``raise_exception(msg)``, ``strftime_now(fmt)``, a ``tojson`` filter that does not escape HTML;
the template sees ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the special
tokens of ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ...) and the template keyword
arguments (which override a special token of the same name). One difference, on purpose:
``strftime_now`` formats the fixed instant of the `now` option, not the clock, so a data set
renders the same bytes every day (a dump resumed tomorrow, a verify next week).

Written here rather than imported because transformers is a test reference, not a dependency of
the package (its tests hold the two equal).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import posixpath
import re
import threading
from dataclasses import dataclass
from typing import Any

import fsspec.core

from logit_distill.errors import InputError

from .tokenizer import TOKENIZER_FILE, _read_bytes, _read_json

TEMPLATE_FILE = "chat_template.jinja"
_GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
# Named special tokens apply_chat_template passes as variables (transformers' SPECIAL_TOKENS_ATTRIBUTES);
# like transformers, any other top-level "*_token" string of tokenizer_config.json is passed too.
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialization: {"content": "...", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_token_variables(tokenizer_config: dict | None) -> dict[str, str]:
    """The special tokens of a tokenizer_config.json as template variables, as transformers 5 sets them."""
    cfg = tokenizer_config or {}
    out = {}
    for key, value in cfg.items():
        if key in _NAMED_SPECIAL_TOKENS or key.endswith("_token"):
            text = _token_text(value)
            if text is not None:
                out[key] = text
    extra = cfg.get("extra_special_tokens")
    if isinstance(extra, dict):  # named model-specific tokens, e.g. {"image_token": "<image>"}
        out.update({k: t for k, v in extra.items() if (t := _token_text(v)) is not None})
    return out


# --------------------------------------------------------------------------- the jinja environment


def _generation_extension():
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationSpans(Extension):
        """``{% generation %}...{% endgeneration %}``: records the character span of its output
        in the text rendered so far (as transformers' AssistantTracker; one render per thread)."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            self.state = threading.local()

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_generation", []), [], [], body).set_lineno(lineno)

        def _generation(self, caller):
            out = caller()
            blocks = getattr(self.state, "blocks", None)
            if blocks is not None:
                start = sum(map(len, blocks))
                self.state.spans.append((start, start + len(out)))
            return out

    return GenerationSpans


def _sandbox_class():
    import types

    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    # The names an exact dict instance has as attributes (its type's and object's; a dict instance
    # has no __dict__ and dict no __getattr__): any other name is looked up as a key.
    dict_attributes = frozenset(dir({}))
    method_types = (types.MethodType, types.BuiltinMethodType)
    builtin_function = types.BuiltinFunctionType  # a builtin function or a builtin type's bound method
    format_names = ("format", "format_map")  # a str's format methods, which jinja2 returns wrapped

    class ChatSandbox(ImmutableSandboxedEnvironment):
        """jinja2's immutable sandbox, making the same decisions faster (most of a render's time
        went to them): ``message.content`` on a plain dict is read as the key without first raising
        AttributeError; the verdict of ``is_safe_attribute`` is kept per (type of the object, name)
        and an attribute with a kept verdict is read without asking again; a builtin function or
        method (``content.strip``, ``message.get``) and ``namespace(...)`` are called directly.

        The verdict is a function of (type, name) only: jinja2 3.1 tests the name, and the object
        with isinstance against fixed types and collections.abc's mutable ABCs; it never reads the
        value. jinja2 refuses a call, or passes the callable the context, by attributes of the
        callable (``unsafe_callable``, ``alters_data``, ``jinja_pass_arg``): a builtin function has no
        attributes of its own, and jinja2's Namespace class, checked once here, none of those. Tests
        compare the attributes given and the calls made with jinja2's own."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._verdicts: dict[tuple[type, str], bool] = {}
            self._namespace_is_plain = self.is_safe_callable(Namespace) and not (
                hasattr(Namespace, "jinja_pass_arg") or hasattr(Namespace.__call__, "jinja_pass_arg"))

        def getattr(self, obj, attribute):
            kind = type(obj)
            if kind is dict and attribute not in dict_attributes:  # what super() does, without the exception
                try:
                    return obj[attribute]
                except KeyError:
                    return self.undefined(obj=obj, name=attribute)
            if obj.__class__ is kind and self._verdicts.get((kind, attribute)):  # super()'s steps, the verdict kept
                try:
                    value = getattr(obj, attribute)
                except AttributeError:
                    try:
                        return obj[attribute]
                    except (TypeError, LookupError):
                        return self.undefined(obj=obj, name=attribute)
                if not (type(value) in method_types and value.__name__ in format_names):
                    return value
            return super().getattr(obj, attribute)

        def is_safe_attribute(self, obj, attr, value):
            kind = type(obj)
            if obj.__class__ is not kind:  # an object that names another class: no shortcut
                return super().is_safe_attribute(obj, attr, value)
            key = (kind, attr)
            verdict = self._verdicts.get(key)
            if verdict is None:
                verdict = self._verdicts[key] = super().is_safe_attribute(obj, attr, value)
            return verdict

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's names: no clash with kwargs
            if type(__obj) is builtin_function or (__obj is Namespace and __self._namespace_is_plain):
                kwargs.pop("_block_vars", None)  # what jinja2's Context.call does then
                kwargs.pop("_loop_vars", None)
                try:
                    return __obj(*args, **kwargs)
                except StopIteration:
                    return __self.undefined("value was undefined because a callable raised a StopIteration "
                                            "exception")
            return super().call(__context, __obj, *args, **kwargs)

    return ChatSandbox


def _environment(now: _dt.datetime):
    import jinja2
    import jinja2.ext

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return now.strftime(format)

    env = _sandbox_class()(trim_blocks=True, lstrip_blocks=True,
                           extensions=[_generation_extension(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


@dataclass
class ChatTemplate:
    text: str
    source: str  # where it was read from (not part of any identity)
    variables: dict[str, str]  # special tokens, then the template keyword arguments
    now: str

    def __post_init__(self):
        import jinja2

        env = _environment(_dt.datetime.fromisoformat(self.now))
        self._spans = next(e for e in env.extensions.values() if hasattr(e, "state"))
        try:
            self._template = env.from_string(self.text)
        except jinja2.TemplateSyntaxError as e:
            raise InputError(f"chat template {self.source}: line {e.lineno}: {e.message}; fix the template") from None
        # The template's globals as one dict rather than jinja2's view of the environment's (a
        # ChainMap, copied key by key into every render's context: two thirds of the fixed cost of
        # a render); the environment is this template's own and its globals are not changed after.
        self._template.globals = dict(self._template.globals)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    @property
    def has_generation_markers(self) -> bool:
        return bool(_GENERATION_TAG.search(self.text))

    def _render_func(self, messages, tools, add_generation_prompt: bool):
        """The template's render generator on a new context: what ``Template.render`` and
        ``generate`` run, the context built in one dict rather than three (its variables over the
        template's globals, as ``Template.new_context`` does)."""
        variables = {**self._template.globals, "messages": messages, "tools": tools, "documents": None,
                     "add_generation_prompt": add_generation_prompt, **self.variables}
        return self._template.root_render_func(self._template.new_context(variables, shared=True))

    def render(self, messages: list[dict], tools: list | None = None, *, add_generation_prompt: bool = False,
               place: str = "") -> str:
        """The text, as ``apply_chat_template(messages, tools=tools, tokenize=False)``."""
        try:
            return "".join(self._render_func(messages, tools, add_generation_prompt))
        except Exception as e:  # noqa: BLE001 - any error raised inside the template is bad input
            raise _template_error(e, place, self.source) from None

    def render_with_generation_spans(self, messages: list[dict], tools: list | None = None, *,
                                     place: str = "") -> tuple[str, list[tuple[int, int]]]:
        """The text and the character spans of its ``{% generation %}`` blocks."""
        blocks: list[str] = []
        state = self._spans.state
        state.blocks, state.spans = blocks, []
        try:
            for block in self._render_func(messages, tools, False):
                blocks.append(block)
            return "".join(blocks), state.spans
        except Exception as e:  # noqa: BLE001
            raise _template_error(e, place, self.source) from None
        finally:
            state.blocks = state.spans = None


def _template_error(e: Exception, place: str, source: str) -> InputError:
    import jinja2

    what = "raised" if type(e) is jinja2.exceptions.TemplateError else f"failed ({type(e).__name__})"
    where = f"{place}: " if place else ""
    return InputError(f"{where}the chat template {what}: {e}; fix the conversation or the template ({source})")


# --------------------------------------------------------------------------- finding the template


def _read_text(url: str, what: str) -> str:
    fs, path = fsspec.core.url_to_fs(url)
    if not fs.isfile(path):
        raise InputError(f"{what} not found: {url}")
    try:
        return _read_bytes(fs, path).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{what} {url} is not UTF-8 text ({e})") from None


def _from_config(config: dict, where: str) -> str | None:
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise InputError(f"{where} holds several chat templates ({sorted(map(str, named))}) and none is named "
                         "'default': pass the one to use as a template file")
    raise InputError(f"{where}: chat_template is a {type(value).__name__}, not a string")


def load_chat_template(tokenizer_path: str | None, *, template_file: str | None, template_kwargs: dict,
                       now: str) -> ChatTemplate | None:
    """The chat template for a tokenizer (a tokenizer.json or its directory), or None when there is none."""
    config = None
    if tokenizer_path:
        fs, path = fsspec.core.url_to_fs(tokenizer_path)
        directory = path if fs.isdir(path) else posixpath.dirname(path)
        cfg_path = posixpath.join(directory, "tokenizer_config.json")
        config = _read_json(fs, cfg_path)
    variables = {**special_token_variables(config), **template_kwargs}
    if template_file:
        return ChatTemplate(_read_text(template_file, "chat template file"), template_file, variables, now)
    if not tokenizer_path:
        return None
    jinja_path = posixpath.join(directory, TEMPLATE_FILE)
    if fs.isfile(jinja_path):
        url = fs.unstrip_protocol(jinja_path)
        return ChatTemplate(_read_text(url, "chat template"), url, variables, now)
    text = _from_config(config or {}, fs.unstrip_protocol(cfg_path))
    if text is None:
        return None
    return ChatTemplate(text, fs.unstrip_protocol(cfg_path), variables, now)


def missing_template_error(data: str, tokenizer_path: str | None) -> InputError:
    where = f"next to {tokenizer_path}" if tokenizer_path else "(no tokenizer given)"
    return InputError(
        f"data {data} holds conversations but there is no chat template {where} ({TEMPLATE_FILE}, or "
        f"`chat_template` in tokenizer_config.json next to {TOKENIZER_FILE}); pass a template file"
    )
