"""Data for the teacher dump: JSONL or Parquet (text, conversations, prompt/completion pairs) or
pre-tokenized ArrayRecord, packed into a deterministic, seekable example order. See docs/DATA.md."""

from logit_distill.errors import InputError

from .conversations import ChatOptions, parse_template_kwargs
from .inputs import TOKEN_DTYPE
from .order import document_order
from .pretokenized import write_pretokenized
from .source import ExampleSource, plan_identity, settings_identity
from .token_cache import default_cache_dir
from .tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "ChatOptions",
    "ExampleSource",
    "InputError",
    "TOKEN_DTYPE",
    "Tokenizer",
    "default_cache_dir",
    "document_order",
    "load_tokenizer",
    "parse_template_kwargs",
    "plan_identity",
    "settings_identity",
    "write_pretokenized",
]
