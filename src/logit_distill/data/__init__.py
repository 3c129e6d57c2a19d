"""Data for the teacher dump: JSONL text or pre-tokenized ArrayRecord, packed into a deterministic,
seekable example order. See docs/DATA.md."""

from logit_distill.errors import InputError

from .inputs import TOKEN_DTYPE, write_pretokenized
from .order import document_order
from .source import ExampleSource, plan_identity, settings_identity
from .token_cache import default_cache_dir
from .tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "ExampleSource",
    "InputError",
    "TOKEN_DTYPE",
    "Tokenizer",
    "default_cache_dir",
    "document_order",
    "load_tokenizer",
    "plan_identity",
    "settings_identity",
    "write_pretokenized",
]
