"""Which tokens of a rendered conversation are training targets (supervised).

A conversation is rendered to one text and tokenized as a whole (``add_special_tokens=False``,
nothing appended: the ids equal ``apply_chat_template(..., tokenize=True)``). The supervised
character spans of that text come from one of two methods:

* generation: the template's ``{% generation %}`` blocks (transformers' ``return_assistant_tokens_mask``);
* prefix: for each supervised turn ``t``, the conversation is rendered up to the turn without it
  (``messages[:t]``, with the generation prompt when the turn is the assistant's) and with it
  (``messages[:t+1]``); the turn's text is their difference, cut after its last special token (the
  turn's end, e.g. ``<|im_end|>``: a newline after it belongs to no turn). For another supervised
  role than the assistant's, the difference includes the turn's header (templates have a
  generation prompt for the assistant only).

  Templates in the manner of Qwen3's render an earlier assistant turn differently once a later
  user turn follows (without its reasoning, without the empty ``<think>`` block of the generation
  prompt). So the turn's span in the full render starts where the full render stops following the
  render without the turn, generation prompt included (at least after the render of ``messages[:t]``
  without the generation prompt, which must be a prefix of it: what the prompt would supply at
  inference is not trained, even when the data disagrees with it, as reasoning under
  ``enable_thinking=false`` does) and, when the render with the turn is not a prefix of the
  full one, ends at the first occurrence, from that start, of the special token that ends the turn
  in that render (``<|im_end|>``). These are the spans a template with ``{% generation %}`` markers
  around each turn's text would give (tested). A template whose earlier turns change in any other
  way is an InputError asking for markers.

A token is supervised when it overlaps a supervised span (as transformers counts tokens of a
generation block). Then: the end-of-turn token (the last token of a span when it is a special
token) is dropped unless `supervise_end_of_turn`; with `mask_empty_reasoning`, tokens lying wholly
inside an empty reasoning block (``<think>`` blanks ``</think>`` and the blanks after it, which
templates insert themselves) are dropped. A prompt/completion pair of strings is tokenized as
``prompt + completion`` followed by EOS (as text documents); the completion's tokens, and EOS as
its end of turn, are supervised.
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np

from logit_distill.errors import InputError

from .chat_template import ChatTemplate
from .conversations import ChatOptions, Completion, Conversation
from .inputs import TOKEN_DTYPE
from .tokenizer import Tokenizer

GENERATION = "generation"
PREFIX = "prefix"


def mask_method(options: ChatOptions, template: ChatTemplate | None) -> str | None:
    """The method used with this template (None without one: prompt/completion strings)."""
    if template is None:
        return None
    if options.mask_method != "auto":
        if options.mask_method == GENERATION and not template.has_generation_markers:
            raise InputError(f"chat template {template.source} has no {{% generation %}} markers: use the prefix "
                             "mask method (or auto)")
        return options.mask_method
    if template.has_generation_markers and options.supervise_roles == ("assistant",):
        return GENERATION
    return PREFIX


def special_token_flags(tokenizer: Tokenizer) -> np.ndarray:
    """bool ``[vocab_size]``: the tokenizer's special added tokens (``<|im_end|>``, ``<eos>``...)."""
    flags = np.zeros(tokenizer.vocab_size, bool)
    for i, tok in tokenizer.hf.get_added_tokens_decoder().items():
        if tok.special and 0 <= i < flags.size:
            flags[i] = True
    return flags


class ChatPreparer:
    """Renders, tokenizes and masks conversations: ``prepare(items)`` -> ``(ids, supervised)`` each."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None, options: ChatOptions):
        self.tokenizer = tokenizer
        self.template = template
        self.options = options
        self.method = mask_method(options, template)
        self.is_special = special_token_flags(tokenizer)
        self.special_texts = [tok.content for tok in tokenizer.hf.get_added_tokens_decoder().values() if tok.special]
        opening, closing = options.reasoning_tags
        self._opening = opening
        self._empty_reasoning = re.compile(re.escape(opening) + r"\s*" + re.escape(closing) + r"\s*")

    # ------------------------------------------------------------------ spans of one item

    def spans(self, item: Conversation | Completion) -> tuple[str, list[tuple[int, int, bool]]]:
        """The text and its supervised character spans ``(start, end, cut after the last special token)``."""
        if isinstance(item, Completion):
            text = item.prompt + item.completion
            return text, [(len(item.prompt), len(text), False)]
        if self.method == GENERATION:
            return self._generation_spans(item)
        return self._prefix_spans(item)

    def _supervised_turns(self, item: Conversation) -> list[int]:
        roles = self.options.supervise_roles
        return [t for t in range(item.first_trainable, len(item.messages)) if item.messages[t]["role"] in roles]

    def _generation_spans(self, item: Conversation):
        text, spans = self.template.render_with_generation_spans(item.messages, item.tools, place=item.place)
        if item.first_trainable >= len(item.messages):  # an empty completion: nothing to train
            return text, []
        if item.first_trainable:  # prompt/completion: blocks of the prompt are not trained
            first = item.messages[item.first_trainable]
            prompt = self.template.render(item.messages[: item.first_trainable], item.tools,
                                          add_generation_prompt=first["role"] == "assistant", place=item.place)
            if not text.startswith(prompt):
                raise self._unstable(item, item.first_trainable)
            spans = [s for s in spans if s[0] >= len(prompt)]
        return text, [(s, e, False) for s, e in spans]

    def _prefix_spans(self, item: Conversation):
        render, msgs, tools, place = self.template.render, item.messages, item.tools, item.place
        full = render(msgs, tools, place=place)
        spans = []
        for t in self._supervised_turns(item):
            prompted = msgs[t]["role"] == "assistant"
            before = self._render_head(msgs[:t], tools, prompted, place)
            after = full if t == len(msgs) - 1 else render(msgs[: t + 1], tools, place=place)
            if full.startswith(before) and after.startswith(before):
                start, head = len(before), before
            else:  # the full render does not follow the generation prompt (see the module docstring)
                head = self._render_head(msgs[:t], tools, False, place) if prompted else before
                if not (full.startswith(head) and after.startswith(head)):
                    raise self._unstable(item, t)
                start = max(len(head), _common_prefix_len(before, full))
            if full.startswith(after):
                end = len(after)
            else:  # the turn reads otherwise once later turns follow: up to its end-of-turn token
                eot = self._last_special(after[len(head):])
                found = full.find(eot, start) if eot else -1
                if found < 0:
                    raise self._unstable(item, t)
                end = found + len(eot)
            spans.append((start, end, True))
        return full, spans

    def _render_head(self, head: list[dict], tools, prompted: bool, place: str) -> str:
        """The render of the turns before a supervised one; before a first message, templates that
        read ``messages[0]`` cannot render an empty conversation: the turn then starts at the text's
        start."""
        try:
            return self.template.render(head, tools, add_generation_prompt=prompted, place=place)
        except InputError:
            if head:
                raise
            return ""

    def _last_special(self, text: str) -> str | None:
        """The special token (by its text) that occurs last in `text`."""
        best, at = None, -1
        for token in self.special_texts:
            i = text.rfind(token)
            if i > at or (i == at and i >= 0 and len(token) > len(best)):
                best, at = token, i
        return best

    def _unstable(self, item: Conversation, t: int) -> InputError:
        return InputError(
            f"{item.place}: the chat template renders the conversation before turn {t} ({item.messages[t]['role']}) "
            "differently once later turns follow, so the turn's tokens cannot be found by rendering prefixes; use a "
            "template with {% generation %} markers around the assistant's text"
        )

    # ------------------------------------------------------------------ tokens

    def supervised_tokens(self, enc, ids: np.ndarray, text: str, spans) -> np.ndarray:
        """uint8 ``[len(ids)]``: 1 where the token is a training target."""
        flags = np.zeros(len(ids), np.uint8)
        for start, end, cut in spans:
            a, b = _first_token(enc, start, end), _last_token(enc, start, end)
            if a is None or b < a:
                continue
            if cut:
                special = self.is_special[ids[a: b + 1]].nonzero()[0]  # (np.flatnonzero: the same, slower)
                if special.size:
                    b = a + int(special[-1])
            if not self.options.supervise_end_of_turn and self.is_special[ids[b]]:
                b -= 1
            flags[a: b + 1] = 1
        if self.options.mask_empty_reasoning and self._opening in text:
            for m in self._empty_reasoning.finditer(text):
                a, b = _first_token(enc, m.start(), m.end()), _last_token(enc, m.start(), m.end())
                if a is None:
                    continue
                if enc.token_to_chars(a)[0] < m.start():  # only tokens wholly inside the block
                    a += 1
                if enc.token_to_chars(b)[1] > m.end():
                    b -= 1
                flags[a: b + 1] = 0
        return flags

    def prepare(self, items: Sequence[Conversation | Completion]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Token ids (int32) and supervision flags (uint8) of each item, tokenized in one batch."""
        rendered = [self.spans(item) for item in items]
        encodings = self.tokenizer.hf.encode_batch([text for text, _ in rendered], add_special_tokens=False)
        out = []
        for item, (text, spans), enc in zip(items, rendered, encodings):
            ids = np.asarray(enc.ids, dtype=TOKEN_DTYPE)
            flags = self.supervised_tokens(enc, ids, text, spans)
            if isinstance(item, Completion):  # EOS after the completion, as after a text document
                ids = np.append(ids, TOKEN_DTYPE.type(self.tokenizer.eos_id))
                flags = np.append(flags, np.uint8(self.options.supervise_end_of_turn))
            out.append((ids, flags))
        return out


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _first_token(enc, start: int, end: int) -> int | None:
    """The first token holding a character of ``[start, end)``. Characters no token holds are rare
    (none with a byte-level BPE): one lookup, in practice, cheaper than reading ``enc.offsets`` (a
    list of every token's pair, built anew at each read)."""
    for c in range(start, end):
        t = enc.char_to_token(c)
        if t is not None:
            return t
    return None


def _last_token(enc, start: int, end: int) -> int:
    for c in range(end - 1, start - 1, -1):
        t = enc.char_to_token(c)
        if t is not None:
            return t
    return -1
