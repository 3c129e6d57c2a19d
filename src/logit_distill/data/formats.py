"""What a data set holds (text, conversations, prompt/completion pairs, token ids), decided without
tokenizing: from the first record of a JSONL data set or the columns of its first Parquet file.

``plan_identity`` and ``ExampleSource.open`` both call ``detect_format``, so the identity planned
before a dump and the one of the opened data agree; the token cache checks every record."""

from __future__ import annotations

from dataclasses import dataclass

from logit_distill.errors import InputError

from .chat_template import ChatTemplate, load_chat_template, missing_template_error
from .conversations import MESSAGES, PROMPT_COMPLETION, TEXT, ChatOptions, format_of_fields, no_format_error
from .inputs import ARRAY_RECORD, JSONL, PARQUET, DataInputs
from .records import iter_jsonl_records, parquet_schema
from .supervision import mask_method

TOKENS = "tokens"  # pre-tokenized ArrayRecord


@dataclass(frozen=True)
class DataFormat:
    format: str  # text | messages | prompt_completion | tokens
    conversational: bool | None  # prompt_completion: message lists (True) or strings (False)
    options: ChatOptions
    template: ChatTemplate | None  # conversations only

    @property
    def is_chat(self) -> bool:
        return self.format in (MESSAGES, PROMPT_COMPLETION)

    def identity(self) -> dict | None:
        """The ``chat`` entry of the data identity; None for text and token ids (their identity is
        what it was before conversations existed)."""
        if not self.is_chat:
            return None
        t = self.template
        return {
            **self.options.identity(),
            "format": self.format,
            "conversational": self.conversational,
            "template_sha256": t.sha256 if t else None,
            "special_tokens": {k: v for k, v in t.variables.items() if k not in self.options.template_kwargs}
            if t else None,
            "mask_method": mask_method(self.options, t),  # as resolved: auto names the method it chose
        }


def _first_jsonl_record(inputs: DataInputs) -> tuple[str, dict] | None:
    for f in inputs.files:
        for place, obj in iter_jsonl_records(f):
            return place, obj
    return None


def _parquet_format(inputs: DataInputs, options: ChatOptions, text_field: str) -> tuple[str, bool | None]:
    import pyarrow as pa

    f = inputs.files[0]
    schema = parquet_schema(f)
    fmt = format_of_fields(schema.names, options, text_field)
    if fmt is None:
        raise no_format_error(f.url, schema.names, options, text_field)
    if fmt != PROMPT_COMPLETION:
        return fmt, None
    if options.prompt_field not in schema.names:
        raise InputError(f"{f.url}: no column {options.prompt_field!r} (columns: {schema.names[:10]}); "
                         "set the field name")
    kind = schema.field(options.prompt_field).type
    return fmt, bool(pa.types.is_list(kind) or pa.types.is_large_list(kind))


def detect_format(inputs: DataInputs, tokenizer_path: str | None, text_field: str,
                  options: ChatOptions | None) -> DataFormat:
    """The format of `inputs`, with the chat template it needs (InputError when it is missing)."""
    options = (options or ChatOptions()).check()
    if inputs.kind == ARRAY_RECORD:
        return DataFormat(TOKENS, None, options, None)
    if inputs.kind == PARQUET:
        fmt, conversational = _parquet_format(inputs, options, text_field)
    else:
        assert inputs.kind == JSONL
        first = _first_jsonl_record(inputs)
        if first is None:  # no record at all: the token cache reports the empty data set
            return DataFormat(TEXT, None, options, None)
        place, record = first
        fmt = format_of_fields(record, options, text_field)
        if fmt is None:
            raise no_format_error(place, record, options, text_field)
        conversational = isinstance(record.get(options.prompt_field), list) if fmt == PROMPT_COMPLETION else None
    if fmt == TEXT:
        return DataFormat(TEXT, None, options, None)
    template = None
    if fmt == MESSAGES or conversational:
        template = load_chat_template(tokenizer_path, template_file=options.chat_template,
                                      template_kwargs=options.template_kwargs, now=options.now)
        if template is None:
            raise missing_template_error(inputs.uri, tokenizer_path)
        mask_method(options, template)  # refuses a forced method the template cannot give
    return DataFormat(fmt, conversational, options, template)
