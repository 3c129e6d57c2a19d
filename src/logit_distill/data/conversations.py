"""Record formats and the options of chat data.

A JSONL line or Parquet row is one of (checked in this order, so a record with both `messages` and
`text` is a conversation):

* ``messages``: a list of ``{"role", "content", ...}``; other keys (``reasoning_content``,
  ``thinking``, ``tool_calls``, ``name``, ...) go to the template untouched;
* ``prompt`` + ``completion``: two strings (the text is their concatenation, the completion is
  supervised) or two message lists (the conversation is their concatenation; only the
  completion's turns are supervised), as TRL's standard and conversational formats;
* ``text``: a document, as before.

The first record of a data set fixes its format; a record of another format is an InputError (one
data set, one format). An optional ``tools`` field (a list of JSON schemas, or that list as a JSON
string) is passed to the template as `tools`.
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from logit_distill.errors import InputError

TEXT = "text"
MESSAGES = "messages"
PROMPT_COMPLETION = "prompt_completion"
FORMATS = ("auto", TEXT, MESSAGES, PROMPT_COMPLETION)
# The options as the pipeline gives them (ChatOptions.from_flat's keywords).
FLAT_FIELDS = ("data_format", "messages_field", "chat_template", "chat_template_kwargs", "supervise_roles",
               "supervise_end_of_turn", "mask_empty_reasoning", "mask_method")
MASK_METHODS = ("auto", "generation", "prefix")
# Variables apply_chat_template sets itself: a template keyword argument may not replace them.
RESERVED_TEMPLATE_NAMES = ("messages", "tools", "documents", "add_generation_prompt")


@dataclass(frozen=True)
class ChatOptions:
    """How conversations are read, rendered and masked (docs/DATA.md, "Conversations").

    Every field that changes the examples is part of the data identity of a chat data set; none
    of them enters the identity of a text data set.
    """

    format: str = "auto"  # auto: from the first record's fields
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    tools_field: str = "tools"
    chat_template: str | None = None  # a template file; None: the tokenizer's own
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {"enable_thinking": False}
    now: str = "2026-01-01T00:00:00"  # what strftime_now() formats: fixed, so renders are reproducible
    roles: tuple[str, ...] = ("system", "developer", "user", "assistant", "tool")
    supervise_roles: tuple[str, ...] = ("assistant",)
    supervise_end_of_turn: bool = True
    mask_empty_reasoning: bool = True
    reasoning_tags: tuple[str, str] = ("<think>", "</think>")
    mask_method: str = "auto"  # auto: generation markers when the template has them, else prefixes

    def check(self) -> "ChatOptions":
        """Raise InputError for a bad option; return self."""
        if self.format not in FORMATS:
            raise InputError(f"chat format must be one of {FORMATS}, got {self.format!r}")
        if self.mask_method not in MASK_METHODS:
            raise InputError(f"mask method must be one of {MASK_METHODS}, got {self.mask_method!r}")
        for name in ("messages_field", "prompt_field", "completion_field", "tools_field"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise InputError(f"{name} must be a non-empty string, got {value!r}")
        if self.chat_template is not None and (not isinstance(self.chat_template, str) or not self.chat_template):
            raise InputError(f"chat_template must be the path of a template file, got {self.chat_template!r}")
        for name in ("roles", "supervise_roles"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not value or not all(isinstance(r, str) and r for r in value):
                raise InputError(f"{name} must be a non-empty tuple of role names, got {value!r}")
        unknown = [r for r in self.supervise_roles if r not in self.roles]
        if unknown:
            raise InputError(f"supervised role {unknown[0]!r} is not one of the roles {list(self.roles)}")
        if self.mask_method == "generation" and self.supervise_roles != ("assistant",):
            raise InputError("{% generation %} markers mark the assistant's text: with other supervised roles "
                             f"({list(self.supervise_roles)}) use the prefix mask method")
        for name in ("supervise_end_of_turn", "mask_empty_reasoning"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name} must be true or false, got {getattr(self, name)!r}")
        tags = self.reasoning_tags
        if not (isinstance(tags, tuple) and len(tags) == 2 and all(isinstance(t, str) and t for t in tags)):
            raise InputError(f"reasoning_tags must be (opening tag, closing tag), got {tags!r}")
        try:
            _dt.datetime.fromisoformat(self.now)
        except (TypeError, ValueError):
            raise InputError(f"now must be an ISO date or date-time such as 2026-01-01T00:00:00, got {self.now!r}") from None
        kwargs = self.template_kwargs
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
            raise InputError(f"template_kwargs must map variable names to values, got {kwargs!r}")
        reserved = [k for k in kwargs if k in RESERVED_TEMPLATE_NAMES]
        if reserved:
            raise InputError(f"template keyword {reserved[0]!r} is set by the renderer itself; drop it")
        try:
            json.dumps(kwargs, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise InputError(f"template_kwargs must be JSON values (they enter the data identity): {e}") from None
        return self

    @classmethod
    def from_flat(cls, *, data_format: str = "auto", messages_field: str = "messages", chat_template: str = "",
                  chat_template_kwargs: str = "", supervise_roles: str = "assistant",
                  supervise_end_of_turn: bool = True, mask_empty_reasoning: bool = True,
                  mask_method: str = "auto") -> "ChatOptions":
        """The options given flat (the pipeline's parameters): ``chat_template`` "" for the tokenizer's,
        ``chat_template_kwargs`` a JSON object ("" for none), ``supervise_roles`` comma-separated."""
        kwargs = {}
        if chat_template_kwargs.strip():
            try:
                kwargs = json.loads(chat_template_kwargs)
            except ValueError as e:
                raise InputError(f"chat_template_kwargs must be a JSON object such as {{\"enable_thinking\": false}}: "
                                 f"{e}") from None
            if not isinstance(kwargs, dict):
                raise InputError(f"chat_template_kwargs must be a JSON object, got {chat_template_kwargs!r}")
        roles = tuple(r.strip() for r in supervise_roles.split(",") if r.strip())
        return cls(format=data_format, messages_field=messages_field, chat_template=chat_template or None,
                   template_kwargs=kwargs, supervise_roles=roles, supervise_end_of_turn=supervise_end_of_turn,
                   mask_empty_reasoning=mask_empty_reasoning, mask_method=mask_method)

    @classmethod
    def from_identity(cls, chat: dict | None) -> "ChatOptions":
        """The options a data set with this ``chat`` identity entry was read with (the store's
        ``content.data.chat``), to read the same data, or held-out data, the same way; the defaults
        for None (text or token ids). The template comes from the tokenizer's folder (the store keeps
        the one its data was rendered with)."""
        if not chat:
            return cls()
        names = {f.name for f in fields(cls)} - {"chat_template"}
        kwargs = {k: chat[k] for k in names if k in chat}
        for k in ("roles", "supervise_roles", "reasoning_tags"):
            if k in kwargs:
                kwargs[k] = tuple(kwargs[k])
        if kwargs.get("mask_method") is None:  # prompt/completion strings: no template, no method
            kwargs["mask_method"] = "auto"
        return cls(**kwargs).check()

    def identity(self) -> dict:
        """The options as JSON (part of the data identity of a chat data set)."""
        out = asdict(self)
        for k in ("roles", "supervise_roles", "reasoning_tags"):
            out[k] = list(out[k])
        out.pop("chat_template")  # where the template came from is no identity; its text is (chat.py)
        out.pop("format")  # the resolved format is recorded instead
        return out


def parse_template_kwargs(items: list[str]) -> dict[str, Any]:
    """``["enable_thinking=false", "name=x"]`` -> ``{"enable_thinking": False, "name": "x"}``: a value
    is read as JSON when it parses (true, 3, [1, 2], "quoted"), else kept as a string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise InputError(f"template keyword argument {item!r} is not NAME=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


# --------------------------------------------------------------------------- formats


def format_of_fields(fields, options: ChatOptions, text_field: str) -> str | None:
    """The format a record (or Parquet file) with these field names has, or None."""
    if options.format != "auto":
        return options.format
    if options.messages_field in fields:
        return MESSAGES
    if options.prompt_field in fields and options.completion_field in fields:
        return PROMPT_COMPLETION
    if text_field in fields:
        return TEXT
    return None


def no_format_error(place: str, fields, options: ChatOptions, text_field: str) -> InputError:
    return InputError(
        f"{place}: neither {options.messages_field!r}, {options.prompt_field!r} + {options.completion_field!r} nor "
        f"{text_field!r} (fields: {sorted(fields)[:10]}); name the field that holds the text or the "
        "conversation (--text-field, --messages-field, --prompt-field with --completion-field)"
    )


def columns_of(fmt: str, options: ChatOptions, text_field: str) -> list[str]:
    """The fields a record of this format is read from (without the optional tools field)."""
    if fmt == MESSAGES:
        return [options.messages_field]
    if fmt == PROMPT_COMPLETION:
        return [options.prompt_field, options.completion_field]
    return [text_field]


@dataclass
class Conversation:
    """Messages to render; turns ``i >= first_trainable`` of a supervised role are supervised."""

    messages: list[dict]
    first_trainable: int
    tools: list | None
    place: str


@dataclass
class Completion:
    """A prompt string and its completion (supervised), rendered as their concatenation."""

    prompt: str
    completion: str
    place: str


def _messages(value: Any, place: str, name: str, options: ChatOptions) -> list[dict]:
    if not isinstance(value, list):
        raise InputError(f"{place}: field {name!r} is a {type(value).__name__}, not a list of messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise InputError(f"{place}: {name}[{i}] is a {type(m).__name__}, not a message object")
        role = m.get("role")
        if role is None:
            raise InputError(f"{place}: {name}[{i}] has no 'role'; every message needs a role and a content")
        if role not in options.roles:
            raise InputError(f"{place}: {name}[{i}] has role {role!r}, not one of {list(options.roles)}; "
                             "fix the data or set the roles option")
        content = m.get("content")
        if content is None and not m.get("tool_calls"):
            raise InputError(f"{place}: {name}[{i}] ({role}) has no 'content' (only a message with tool_calls may "
                             "omit it)")
        if content is not None and not isinstance(content, (str, list)):
            raise InputError(f"{place}: {name}[{i}] content is a {type(content).__name__}, not a string or a list "
                             "of content parts")
    return value


def _tools(record: dict, place: str, options: ChatOptions) -> list | None:
    tools = record.get(options.tools_field)
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as e:
            raise InputError(f"{place}: field {options.tools_field!r} is a string but not JSON ({e})") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise InputError(f"{place}: field {options.tools_field!r} must be a list of tool schemas (objects)")
    return tools or None


def parse_record(record: dict, fmt: str, conversational: bool | None, options: ChatOptions, text_field: str,
                 place: str) -> str | Conversation | Completion:
    """One record of a data set of format `fmt` as a text, a Conversation or a Completion.

    `conversational` (prompt/completion only) is whether the data set's prompts are message lists;
    None for the first record, which sets it.
    """
    got = format_of_fields(record, options, text_field)
    if got is None:
        raise no_format_error(place, record, options, text_field)
    if got != fmt:
        raise InputError(f"{place}: a {got} record in a data set of {fmt} records (the first record decides); "
                         "use one format per data set")
    missing = [c for c in columns_of(fmt, options, text_field) if c not in record]
    if missing:  # a format set by the options
        raise InputError(f"{place}: no field {missing[0]!r} (fields: {sorted(record)[:10]}); set the field name")
    if fmt == TEXT:
        text = record[text_field]
        if not isinstance(text, str):
            raise InputError(f"{place}: field {text_field!r} is a {type(text).__name__}, not a string")
        return text
    if fmt == MESSAGES:
        messages = _messages(record[options.messages_field], place, options.messages_field, options)
        return Conversation(messages, 0, _tools(record, place, options), place)
    prompt, completion = record[options.prompt_field], record[options.completion_field]
    is_conv = isinstance(prompt, list)
    if conversational is not None and is_conv != conversational:
        kind = "message lists" if conversational else "strings"
        raise InputError(f"{place}: prompt/completion of another kind than the first record's ({kind}); "
                         "use one format per data set")
    if not is_conv:
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise InputError(f"{place}: {options.prompt_field!r} and {options.completion_field!r} must both be "
                             "strings or both be message lists")
        return Completion(prompt, completion, place)
    p = _messages(prompt, place, options.prompt_field, options)
    c = _messages(completion, place, options.completion_field, options)
    return Conversation(p + c, len(p), _tools(record, place, options), place)
