"""Conversations in, masks out: chat templates rendered and tokenized as transformers does, assistant-only
supervision (from {% generation %} markers or by rendering prefixes), JSONL / Parquet / gs:// inputs,
the example's loss mask, the data identity, supervised pre-tokenized records and bad input.

transformers' ``apply_chat_template`` (on a fast tokenizer loaded from the same directory) is the
reference for texts, ids and assistant masks; the templates in ``chat_templates/`` are written for
these tests (chat_helpers.py).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import pickle

import numpy as np
import pytest

from chat_helpers import CONVERSATIONS, WEATHER_TOOL, hf_tokenizer, template_text, write_chat_tokenizer
from logit_distill.data import ChatOptions, ExampleSource, InputError, load_tokenizer, parse_template_kwargs
from logit_distill.data import plan_identity, settings_identity, write_pretokenized
from logit_distill.data.chat_template import ChatTemplate, load_chat_template, special_token_variables
from logit_distill.data.conversations import Completion, Conversation
from logit_distill.data.supervision import ChatPreparer

MASK64 = (1 << 64) - 1
# Which conversations each template family renders (Gemma alternates user/model, no tools; the
# Llama-style and marked templates here render no tool calls).
CASES = {
    "chatml_think_tools": ["simple", "multi", "reasoning", "multi_reasoning", "tools", "unicode"],
    "chatml_generation": ["simple", "multi", "reasoning", "multi_reasoning", "unicode"],
    "llama3_header": ["simple", "multi", "unicode"],
    "gemma_fold_system": ["simple", "multi", "unicode"],
}
PAIRS = [(family, conv) for family, convs in CASES.items() for conv in convs]


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    """One tokenizer directory per template family (the template in tokenizer_config.json)."""
    root = tmp_path_factory.mktemp("chat-tok")
    return {family: write_chat_tokenizer(root / family, family) for family in CASES}


@pytest.fixture()
def fixed_clock(monkeypatch):
    """transformers' strftime_now reads the clock: pin it to our default `now` for the comparison."""
    import transformers.utils.chat_template_utils as ctu

    now = datetime.datetime.fromisoformat(ChatOptions().now)

    class Clock(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return now

    monkeypatch.setattr(ctu, "datetime", Clock)


def _tools(conv_name):
    return [WEATHER_TOOL] if conv_name == "tools" else None


def _preparer(tok_dir, options=ChatOptions(), template_file=None):
    template = load_chat_template(tok_dir, template_file=template_file, template_kwargs=options.template_kwargs,
                                  now=options.now)
    return ChatPreparer(load_tokenizer(tok_dir), template, options)


def _prepare(preparer, messages, tools=None, first_trainable=0):
    ((ids, flags),) = preparer.prepare([Conversation(messages, first_trainable, tools, "test")])
    return ids.tolist(), flags.tolist()


def _runs(hf, ids, flags) -> list[str]:
    """The supervised text, one string per contiguous run of supervised tokens."""
    out, cur = [], []
    for i, f in zip(ids, flags):
        if f:
            cur.append(i)
        elif cur:
            out.append(hf.decode(cur))
            cur = []
    return out + ([hf.decode(cur)] if cur else [])


# ----------------------------------------------------------------------------- rendering = transformers


@pytest.mark.parametrize("family,conv", PAIRS)
def test_text_and_ids_equal_transformers(tok_dirs, fixed_clock, family, conv):
    d = tok_dirs[family]
    hf = hf_tokenizer(d)
    messages, tools = CONVERSATIONS[conv], _tools(conv)
    p = _preparer(d)
    assert p.template.render(messages, tools) == hf.apply_chat_template(messages, tools=tools, tokenize=False)
    ids, _ = _prepare(p, messages, tools)
    assert ids == hf.apply_chat_template(messages, tools=tools, tokenize=True)["input_ids"]
    # The prefix renders (with the generation prompt) are transformers' too.
    head = messages[:-1]
    assert p.template.render(head, tools, add_generation_prompt=True) == hf.apply_chat_template(
        head, tools=tools, tokenize=False, add_generation_prompt=True)


def test_template_kwargs_and_special_tokens_reach_the_template(tok_dirs, fixed_clock):
    hf = hf_tokenizer(tok_dirs["chatml_think_tools"])
    head = CONVERSATIONS["multi"][:3]
    p = _preparer(tok_dirs["chatml_think_tools"], ChatOptions(template_kwargs={"enable_thinking": False}))
    text = p.template.render(head, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert text == hf.apply_chat_template(head, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    # Llama-style: BOS from tokenizer_config.json, the date from strftime_now (pinned) or date_string.
    llama = _preparer(tok_dirs["llama3_header"])
    text = llama.template.render(CONVERSATIONS["multi"])
    assert text.startswith("<|begin_of_text|><|start_header_id|>system") and "Today Date: 01 Jan 2026" in text
    assert "You are a helpful assistant." in text  # the default system prompt
    dated = _preparer(tok_dirs["llama3_header"], ChatOptions(template_kwargs={"date_string": "3 Mar 2025"}))
    assert dated.template.render(CONVERSATIONS["multi"]) == hf_tokenizer(tok_dirs["llama3_header"]).apply_chat_template(
        CONVERSATIONS["multi"], tokenize=False, date_string="3 Mar 2025")
    later = _preparer(tok_dirs["llama3_header"], ChatOptions(now="2027-05-04"))
    assert "Today Date: 04 May 2027" in later.template.render(CONVERSATIONS["multi"])


def test_special_token_variables_are_those_of_transformers(tmp_path):
    d = write_chat_tokenizer(tmp_path / "t", "gemma_fold_system", extra_config={
        "unk_token": {"content": "<eos>", "__type": "AddedToken"}, "image_token": "<image>"})
    hf = hf_tokenizer(d)
    with open(os.path.join(d, "tokenizer_config.json")) as f:
        assert special_token_variables(json.load(f)) == dict(hf.special_tokens_map)


def test_where_the_template_comes_from(tmp_path):
    # tokenizer_config.json, overridden by chat_template.jinja, overridden by an explicit file (as transformers).
    d = write_chat_tokenizer(tmp_path / "t", "chatml_think_tools", where="config")
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write(template_text("chatml_generation"))
    kw = dict(template_kwargs={}, now=ChatOptions().now)
    assert load_chat_template(d, template_file=None, **kw).text == template_text("chatml_generation")
    assert load_chat_template(d, template_file=None, **kw).text == hf_tokenizer(d).chat_template
    explicit = tmp_path / "gemma.jinja"
    explicit.write_text(template_text("gemma_fold_system"))
    assert load_chat_template(d, template_file=str(explicit), **kw).text == template_text("gemma_fold_system")
    # The list form of tokenizer_config.json: the template named "default".
    listed = write_chat_tokenizer(tmp_path / "l", "chatml_think_tools", where="none", extra_config={
        "chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "{{ 'd' }}"}]})
    assert load_chat_template(listed, template_file=None, **kw).text == "{{ 'd' }}"
    assert load_chat_template(write_chat_tokenizer(tmp_path / "n", where="none"), template_file=None, **kw) is None


def test_the_sandbox_decides_as_jinja2s_own():
    # The template's sandbox reads plain dicts' keys directly and keeps its verdicts per (type, name):
    # every attribute it gives or refuses is what jinja2's ImmutableSandboxedEnvironment gives or refuses.
    import collections
    import types

    from jinja2 import Undefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    ours, theirs = ChatTemplate("", "t", {}, ChatOptions().now)._template.environment, ImmutableSandboxedEnvironment()

    def same(got, want):
        if isinstance(want, Undefined):
            return type(got) is type(want) and all(getattr(got, a) == getattr(want, a) for a in (
                "_undefined_hint", "_undefined_name", "_undefined_exception"))
        if hasattr(want, "__wrapped__"):  # str.format, wrapped by the sandbox anew at each access
            return got.__wrapped__ == want.__wrapped__
        return got == want

    objects = ["text", {"content": "c", "items": "i", "_x": 1}, [1], {1}, collections.deque(), 1.5, None, same,
               "s".upper, str, (x for x in ()), Namespace(a=1), types.SimpleNamespace(a=1)]
    names = ["content", "items", "keys", "get", "clear", "update", "pop", "append", "add", "upper", "format", "mro",
             "a", "_x", "__class__", "__globals__", "__code__", "gi_frame", "__self__", "missing"]
    for obj in objects:
        for name in names:
            for _ in range(2):  # the second time from the kept verdict
                value = getattr(obj, name, None)
                verdict = ours.is_safe_attribute(obj, name, value)
                assert verdict == theirs.is_safe_attribute(obj, name, value), (obj, name)
                assert same(ours.getattr(obj, name), theirs.getattr(obj, name)), (obj, name)
    with pytest.raises(InputError, match="SecurityError"):  # a template may still not change its input
        ChatTemplate("{{ messages.append(1) }}", "t", {}, ChatOptions().now).render([])


def test_the_sandbox_calls_as_jinja2s_own():
    # Builtin functions and methods and namespace(...) are called directly: each call gives what
    # jinja2's ImmutableSandboxedEnvironment gives (or raises what it raises).
    import jinja2
    from jinja2 import Undefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError, unsafe
    from jinja2.utils import Namespace

    ours = ChatTemplate("", "t", {}, ChatOptions().now)._template
    theirs = ImmutableSandboxedEnvironment().from_string("")
    envs = [(t.environment, t.new_context({"x": 1})) for t in (ours, theirs)]

    def outcome(env, context, make_call):
        fn, args, kwargs = make_call()
        try:
            got = env.call(context, fn, *args, **kwargs)
        except Exception as e:  # noqa: BLE001
            return ("raised", type(e), str(e))
        if isinstance(got, Undefined):
            return ("undefined", type(got), got._undefined_hint)
        if isinstance(got, Namespace):
            return ("namespace", got.a, got.b)
        return ("value", got, args)

    calls = {
        "str method": lambda: (" a b\n".strip, ("\n",), {"_loop_vars": {"c": 1}}),
        "split": lambda: ("a</think>b".split, ("</think>",), {"_block_vars": {}, "_loop_vars": {}}),
        "dict.get": lambda: ({"k": 1}.get, ("k", 0), {}),
        "list.append (refused by getattr, not by call)": lambda: ([1].append, (2,), {}),
        "builtin function": lambda: (len, ([1, 2],), {}),
        "bad arguments": lambda: ("x".strip, (1,), {}),
        "StopIteration": lambda: (next, (iter([]),), {}),
        "namespace": lambda: (Namespace, ({"a": 1},), {"b": 2, "_loop_vars": {"a": 0}}),
        "pass_context": lambda: (jinja2.pass_context(lambda ctx, y: (ctx["x"], y)), (2,), {}),
        "unsafe": lambda: (unsafe(lambda: 1), (), {}),
        "class": lambda: (dict, (), {"a": 1}),
    }
    for name, make_call in calls.items():
        got, want = (outcome(env, context, make_call) for env, context in envs)
        assert got == want, name
    assert outcome(*envs[0], calls["unsafe"])[1] is SecurityError
    assert ours.environment._namespace_is_plain


# ----------------------------------------------------------------------------- masks


@pytest.mark.parametrize("conv", CASES["chatml_generation"])
def test_generation_mask_equals_transformers_assistant_mask(tok_dirs, conv):
    d = tok_dirs["chatml_generation"]
    messages = CONVERSATIONS[conv]
    ref = hf_tokenizer(d).apply_chat_template(messages, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
    p = _preparer(d, ChatOptions(mask_empty_reasoning=False))
    assert p.method == "generation"
    ids, flags = _prepare(p, messages)
    assert ids == ref["input_ids"] and flags == ref["assistant_masks"]
    assert sum(flags) > 0


@pytest.mark.parametrize("end_of_turn", [True, False])
@pytest.mark.parametrize("empty_reasoning", [True, False])
def test_both_mask_methods_agree_on_a_marked_template(tok_dirs, end_of_turn, empty_reasoning):
    d = tok_dirs["chatml_generation"]
    opts = dict(supervise_end_of_turn=end_of_turn, mask_empty_reasoning=empty_reasoning)
    by_markers = _preparer(d, ChatOptions(**opts))
    by_prefixes = _preparer(d, ChatOptions(mask_method="prefix", **opts))
    assert (by_markers.method, by_prefixes.method) == ("generation", "prefix")
    for conv in CASES["chatml_generation"]:
        assert _prepare(by_markers, CONVERSATIONS[conv]) == _prepare(by_prefixes, CONVERSATIONS[conv]), conv


def _marked_think_tools() -> str:
    """chatml_think_tools with {% generation %} around each assistant turn's text."""
    text = template_text("chatml_think_tools")
    marked = (text.replace("{#- body: the marked variant of this template opens a generation block here #}",
                           "{%- generation %}").replace("{#- end of body #}", "{%- endgeneration %}"))
    assert marked.count("generation %}") == 2
    return marked


@pytest.mark.parametrize("conv", CASES["chatml_think_tools"])
@pytest.mark.parametrize("thinking", [None, False])
def test_prefix_mask_of_a_template_that_rewrites_history_equals_its_marked_variant(tmp_path, tok_dirs, conv,
                                                                                   thinking):
    """The Qwen3 manner: earlier turns lose their reasoning and the empty think block once a user turn
    follows. Rendering prefixes still finds each turn's tokens, as markers would."""
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    marked = tmp_path / "marked.jinja"
    marked.write_text(_marked_think_tools())
    plain = _preparer(tok_dirs["chatml_think_tools"], ChatOptions(template_kwargs=kwargs))
    by_markers = _preparer(tok_dirs["chatml_think_tools"], ChatOptions(template_kwargs=kwargs),
                           template_file=str(marked))
    assert (plain.method, by_markers.method) == ("prefix", "generation")
    messages, tools = CONVERSATIONS[conv], _tools(conv)
    if thinking is False and messages[-1].get("reasoning_content"):
        # Reasoning under enable_thinking=false: the generation prompt's "<think>\n" is given, the
        # turn starts where the render leaves the prompt (the markers variant starts at <think>).
        hf = hf_tokenizer(tok_dirs["chatml_think_tools"])
        runs = _runs(hf, *_prepare(plain, messages, tools))
        assert runs[-1] == messages[-1]["reasoning_content"] + "\n</think>\n\n" + messages[-1]["content"] + "<|im_end|>"
        return
    assert _prepare(plain, messages, tools) == _prepare(by_markers, messages, tools)


def test_supervised_text_of_each_template(tok_dirs):
    """What is supervised, written out: the assistant's text and its end-of-turn token, no header,
    no prompt, no empty think block; the separators after the end of turn belong to no turn."""
    expect = {
        ("chatml_think_tools", "multi_reasoning"): ["No.<|im_end|>",
                                                    "<think>\nNo divisor up to 3.\n</think>\n\nYes, 11 is.<|im_end|>"],
        ("chatml_think_tools", "simple"): ["Hi there, team!<|im_end|>"],
        ("chatml_think_tools", "tools"): [
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
            "It is 21 °C in Paris.<|im_end|>"],
        ("llama3_header", "multi"): ["It is 4.<|eot_id|>", "12, the answer.<|eot_id|>"],
        ("gemma_fold_system", "simple"): ["Hi there, team!<end_of_turn>"],
        ("gemma_fold_system", "unicode"): ["Ça va — très bien ✓ 日本<end_of_turn>"],
    }
    for (family, conv), want in expect.items():
        hf = hf_tokenizer(tok_dirs[family])
        ids, flags = _prepare(_preparer(tok_dirs[family]), CONVERSATIONS[conv], _tools(conv))
        assert _runs(hf, ids, flags) == want, (family, conv)


def test_mask_options(tok_dirs):
    d = tok_dirs["chatml_think_tools"]
    hf = hf_tokenizer(d)
    simple, multi = CONVERSATIONS["simple"], CONVERSATIONS["multi"]
    # The empty think block the template inserts: masked by default, kept on request.
    ids, flags = _prepare(_preparer(d, ChatOptions(mask_empty_reasoning=False)), simple)
    assert _runs(hf, ids, flags) == ["<think>\n\n</think>\n\nHi there, team!<|im_end|>"]
    # The end-of-turn token.
    ids, flags = _prepare(_preparer(d, ChatOptions(supervise_end_of_turn=False)), multi)
    assert _runs(hf, ids, flags) == ["It is 4.", "12, the answer."]
    # Other roles (prefix method: their header is part of their turn).
    ids, flags = _prepare(_preparer(tok_dirs["chatml_generation"], ChatOptions(supervise_roles=("user",))), multi)
    assert _runs(hf, ids, flags) == ["<|im_start|>user\nWhat is 2+2?<|im_end|>", "<|im_start|>user\nAnd times 3?<|im_end|>"]
    # ... which a template that rewrites earlier turns refuses in one line.
    with pytest.raises(InputError, match="renders the conversation before turn 2 \\(user\\) differently"):
        _prepare(_preparer(d, ChatOptions(supervise_roles=("user",))), multi)
    # Prompt/completion as message lists: only the completion's turns.
    ids, flags = _prepare(_preparer(d), multi, first_trainable=2)
    assert _runs(hf, ids, flags) == ["12, the answer.<|im_end|>"]
    ids, flags = _prepare(_preparer(tok_dirs["chatml_generation"]), multi, first_trainable=2)
    assert _runs(hf, ids, flags) == ["12, the answer.<|im_end|>"]
    for family in ("chatml_generation", "chatml_think_tools"):  # an empty completion trains nothing
        assert sum(_prepare(_preparer(tok_dirs[family]), multi, first_trainable=4)[1]) == 0
    # Reasoning tags are settable: with others, the <think> block is not recognised as empty.
    ids, flags = _prepare(_preparer(d, ChatOptions(reasoning_tags=("<reason>", "</reason>"))), simple)
    assert _runs(hf, ids, flags)[0].startswith("<think>")


def test_prompt_completion_strings(tok_dirs):
    d = tok_dirs["chatml_think_tools"]
    tok = load_tokenizer(d)
    p = _preparer(d)
    ((ids, flags),) = p.prepare([Completion("The capital of France is", " Paris.", "x")])
    assert ids.tolist() == tok.encode("The capital of France is Paris.") + [tok.eos_id]
    hf = hf_tokenizer(d)
    assert _runs(hf, ids.tolist(), flags.tolist()) == [" Paris.<|im_end|>"]  # EOS: the completion's end
    ((_, flags),) = _preparer(d, ChatOptions(supervise_end_of_turn=False)).prepare([Completion("A", " b", "x")])
    assert flags.tolist()[-1] == 0


# ----------------------------------------------------------------------------- examples


def _write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def _write_parquet(path, records):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), str(path))
    return str(path)


def _order(n, seed):
    def sm(x):
        x = (x + 0x9E3779B97F4A7C15) & MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
        return x ^ (x >> 31)

    m = sm(seed)
    return sorted(range(n), key=lambda d: sm(d ^ m))


def _brute_examples(docs, sups, seed, L, pad, packing):
    """(tokens, loss_mask) of every example, independently: documents in the splitmix64 order,
    packed (or windowed), the prediction at j trained iff j + 1 is in the same document piece of the
    example and token j + 1 is supervised."""
    pieces = []  # per example: list of (tokens, sups) of its document pieces
    if packing:
        stream = [(t, s, d) for d in _order(len(docs), seed) for t, s in zip(docs[d], sups[d])]
        for a in range(0, len(stream), L):
            chunk, cur = stream[a: a + L], []
            for j, (t, s, d) in enumerate(chunk):
                if j == 0 or chunk[j - 1][2] != d:
                    cur.append(([], []))
                cur[-1][0].append(t)
                cur[-1][1].append(s)
            pieces.append(cur)
    else:
        for d in _order(len(docs), seed):
            for a in range(0, len(docs[d]), L):
                pieces.append([(docs[d][a: a + L], sups[d][a: a + L])])
    out = []
    for ex in pieces:
        tokens, mask = [], []
        for toks, ss in ex:
            tokens += toks
            mask += [bool(ss[j + 1]) for j in range(len(toks) - 1)] + [False]
        n = len(tokens)
        out.append((tokens + [pad] * (L - n), mask + [False] * (L - n)))
    return out


def _assert_examples(src, expected):
    assert len(src) == len(expected)
    for i, (tokens, mask) in enumerate(expected):
        ex = src[i]
        assert ex["tokens"].tolist() == tokens, f"tokens of example {i}"
        assert ex["loss_mask"].dtype == bool and ex["loss_mask"].tolist() == mask, f"loss_mask of example {i}"


CHAT_DATA = [CONVERSATIONS[c] for c in ("simple", "multi", "reasoning", "multi_reasoning", "unicode")] * 3


@pytest.mark.parametrize("packing,L", [(True, 24), (True, 61), (False, 32)])
def test_examples_carry_transformers_ids_and_assistant_masks(tok_dirs, tmp_path, packing, L):
    d = tok_dirs["chatml_generation"]
    data = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": m, "id": i} for i, m in enumerate(CHAT_DATA)])
    opts = ChatOptions(mask_empty_reasoning=False)
    src = ExampleSource.open(data, d, seq_len=L, packing=packing, seed=3, chat=opts)
    hf = hf_tokenizer(d)
    refs = [hf.apply_chat_template(m, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            for m in CHAT_DATA]
    docs, sups = [r["input_ids"] for r in refs], [r["assistant_masks"] for r in refs]
    _assert_examples(src, _brute_examples(docs, sups, 3, L, load_tokenizer(d).eos_id, packing))
    assert src.format == "messages" and src.num_documents == len(CHAT_DATA)
    assert src.num_tokens == sum(map(len, docs)) and src.skipped_unsupervised == 0
    b = src.batch([0, 1])
    assert b["loss_mask"].shape == (2, L) and b["loss_mask"].dtype == bool
    clone = pickle.loads(pickle.dumps(src))  # a Grain worker re-opens the supervision flags too
    assert clone[len(src) - 1]["loss_mask"].tolist() == src[len(src) - 1]["loss_mask"].tolist()


def test_parquet_reads_as_the_jsonl_does(tok_dirs, tmp_path):
    d = tok_dirs["chatml_think_tools"]
    records = [{"messages": m, "tools": json.dumps([WEATHER_TOOL]) if i == 4 else None}
               for i, m in enumerate(CHAT_DATA[:4] + [CONVERSATIONS["tools"]])]
    jsonl = _write_jsonl(tmp_path / "c.jsonl", [{k: v for k, v in r.items() if v is not None} for r in records])
    pq_dir = tmp_path / "pq"
    pq_dir.mkdir()
    _write_parquet(pq_dir / "train-00000-of-00002.parquet", records[:2])
    _write_parquet(pq_dir / "train-00001-of-00002.parquet", records[2:])
    a = ExampleSource.open(jsonl, d, seq_len=40, seed=1)
    b = ExampleSource.open(str(pq_dir), d, seq_len=40, seed=1)
    assert b.identity["data_kind"] == "parquet" and b.format == "messages"
    for i in range(len(a)):
        for k in ("tokens", "loss_mask", "segment_ids"):
            assert a[i][k].tolist() == b[i][k].tolist(), (i, k)
    assert {k: v for k, v in a.identity.items() if k not in ("data_kind", "data_sha256")} == \
        {k: v for k, v in b.identity.items() if k not in ("data_kind", "data_sha256")}
    # Text in Parquet: as text in JSONL.
    texts = ["alpha beta", "gamma", "délta ε"]
    t1 = ExampleSource.open(_write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts]), d, seq_len=8)
    t2 = ExampleSource.open(_write_parquet(tmp_path / "t.parquet", [{"text": t} for t in texts]), d, seq_len=8)
    assert t1.batch(range(len(t1)))["tokens"].tolist() == t2.batch(range(len(t2)))["tokens"].tolist()
    assert "chat" not in t2.identity and t2.identity["text_field"] == "text"


def test_parquet_nulls_of_absent_keys_are_dropped(tmp_path):
    """A struct column has one schema: a message without `reasoning_content` reads it as null. The
    template must see it absent, as in the JSONL."""
    from logit_distill.data.inputs import resolve_inputs
    from logit_distill.data.records import iter_parquet_records

    path = _write_parquet(tmp_path / "m.parquet", [{"messages": CONVERSATIONS["reasoning"]}])
    (f,) = resolve_inputs(path).files
    ((place, rec),) = list(iter_parquet_records(f, ["messages"], nested=("messages",)))
    assert rec["messages"] == CONVERSATIONS["reasoning"] and place.endswith("m.parquet row 0")


def test_prompt_completion_records(tok_dirs, tmp_path):
    d = tok_dirs["chatml_think_tools"]
    multi = CONVERSATIONS["multi"]
    conv = _write_jsonl(tmp_path / "pc.jsonl", [{"prompt": multi[:2], "completion": multi[2:]}])
    src = ExampleSource.open(conv, d, seq_len=200, packing=False)
    full = ExampleSource.open(_write_jsonl(tmp_path / "m.jsonl", [{"messages": multi}]), d, seq_len=200, packing=False)
    assert src.format == "prompt_completion" and src.identity["chat"]["conversational"] is True
    assert src[0]["tokens"].tolist() == full[0]["tokens"].tolist()
    # Only the completion's assistant turn is trained: a subset of the messages' mask.
    assert 0 < src[0]["loss_mask"].sum() < full[0]["loss_mask"].sum()
    assert not (src[0]["loss_mask"] & ~full[0]["loss_mask"]).any()
    text = ExampleSource.open(_write_jsonl(tmp_path / "s.jsonl", [{"prompt": "2+2=", "completion": "4"}]), d,
                              seq_len=8, packing=False)
    tok = load_tokenizer(d)
    ids = tok.encode("2+2=4") + [tok.eos_id]
    assert text[0]["tokens"].tolist()[: len(ids)] == ids
    # The prediction of "4" (from "=") and of EOS (from "4") are trained, nothing else.
    assert np.flatnonzero(text[0]["loss_mask"]).tolist() == [len(ids) - 3, len(ids) - 2]
    assert text.identity["chat"]["conversational"] is False and text.identity["chat"]["template_sha256"] is None


def test_unsupervised_conversations_are_skipped_and_counted(tok_dirs, tmp_path):
    d = tok_dirs["chatml_think_tools"]
    records = [{"messages": CONVERSATIONS["simple"]}, {"messages": [{"role": "user", "content": "hello?"}]},
               {"messages": CONVERSATIONS["multi"]}]
    src = ExampleSource.open(_write_jsonl(tmp_path / "c.jsonl", records), d, seq_len=16)
    assert src.num_documents == 2 and src.skipped_unsupervised == 1
    only = _write_jsonl(tmp_path / "none.jsonl", [{"messages": [{"role": "user", "content": "hello?"}]}])
    with pytest.raises(InputError, match="1 without a supervised token"):
        ExampleSource.open(only, d, seq_len=16)


def test_chat_data_on_gcs(tok_dirs, tmp_path, gcs_bucket):
    import gcsfs

    d = tok_dirs["chatml_generation"]
    local = _write_parquet(tmp_path / "c.parquet", [{"messages": m} for m in CHAT_DATA[:5]])
    fs = gcsfs.GCSFileSystem(token="anon")
    fs.put_file(local, f"{gcs_bucket}/chat/c.parquet".removeprefix("gs://"))
    uri = f"{gcs_bucket}/chat/*.parquet"
    src = ExampleSource.open(uri, d, seq_len=32, seed=2)
    assert plan_identity(uri, d, seq_len=32, seed=2) == settings_identity(src.identity)
    ref = ExampleSource.open(local, d, seq_len=32, seed=2)
    assert src.batch(range(len(src)))["loss_mask"].tolist() == ref.batch(range(len(ref)))["loss_mask"].tolist()


# ----------------------------------------------------------------------------- identity


def test_chat_identity(tok_dirs, tmp_path):
    d = tok_dirs["chatml_generation"]
    data = _write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in CHAT_DATA[:4]])
    base = ExampleSource.open(data, d, seq_len=16)
    assert plan_identity(data, d, seq_len=16) == settings_identity(base.identity)
    chat = base.identity["chat"]
    assert chat["template_sha256"] and chat["mask_method"] == "generation" and chat["special_tokens"]["eos_token"] == "<|im_end|>"
    assert base.identity["text_field"] is None
    json.dumps(base.identity)
    cache_keys = {base._cache.dir}
    variants = [ChatOptions(template_kwargs={"enable_thinking": False}), ChatOptions(supervise_end_of_turn=False),
                ChatOptions(mask_empty_reasoning=False), ChatOptions(supervise_roles=("assistant", "user")),
                ChatOptions(now="2025-02-03"), ChatOptions(roles=("user", "assistant", "system", "tool", "ipython"))]
    for opts in variants:
        src = ExampleSource.open(data, d, seq_len=16, chat=opts)
        assert src.identity["chat"] != chat, opts
        assert plan_identity(data, d, seq_len=16, chat=opts) == settings_identity(src.identity)
        cache_keys.add(src._cache.dir)
    assert len(cache_keys) == len(variants) + 1  # each set of options has its own token cache
    # Another template text: another identity (here an explicit file).
    other = tmp_path / "t.jinja"
    other.write_text(template_text("chatml_generation") + "\n")
    assert plan_identity(data, d, seq_len=16, chat=ChatOptions(chat_template=str(other)))["chat"]["template_sha256"] \
        != chat["template_sha256"]


def test_text_identity_is_unchanged(tok_dirs, tmp_path):
    """A text data set's identity is exactly what it was before conversations existed (stores resume):
    the same fields, the same values, whatever chat options are given."""
    d = tok_dirs["chatml_think_tools"]
    data = tmp_path / "t.jsonl"
    data.write_bytes(b'{"text": "hello world"}\n{"text": "second doc"}\n')
    src = ExampleSource.open(str(data), d, seq_len=8, seed=5)
    tok = load_tokenizer(d)
    # Computed by the release before conversations, for these bytes (sha256 of name, size, content digest).
    assert src.identity == {
        "format": "logit-distill-data/1", "order": "splitmix64-argsort/1", "data_kind": "jsonl",
        "data_sha256": "30b997d7be9fd959c2074f7a7fd44f3645779b8499f4ae6cef60660c61e27e36",
        "tokenizer_sha256": tok.identity, "eos_id": 269, "pad_id": 269, "text_field": "text",
        "seed": 5, "seq_len": 8, "packing": True, "num_documents": 2, "num_tokens": 21, "num_examples": 3,
    }
    # The token cache key too (the previous release's formula), so existing caches are reused.
    old_key = {"version": 1, "data": src.identity["data_sha256"], "kind": "jsonl", "tokenizer": tok.identity,
               "eos_id": 269, "text_field": "text"}
    assert os.path.basename(src._cache.dir) == hashlib.sha256(json.dumps(old_key, sort_keys=True).encode()).hexdigest()
    other = ExampleSource.open(str(data), d, seq_len=8, seed=5, chat=ChatOptions(supervise_end_of_turn=False))
    assert other.identity == src.identity and other._cache.dir == src._cache.dir


# ----------------------------------------------------------------------------- pre-tokenized with supervision


def test_supervised_pretokenized_records(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 300, size=n) for n in (5, 9, 3, 12)]
    sups = [rng.integers(0, 2, size=len(x)) for x in docs]
    sups[1][:] = 0  # a document without a target: skipped and counted
    sups[0][0] = 1
    path = str(tmp_path / "sup" / "a.array_record")
    write_pretokenized(path, docs, supervised=sups)
    src = ExampleSource.open(path, None, seq_len=7, seed=1)
    assert src.num_documents == 3 and src.skipped_unsupervised == 1
    keep = [0, 2, 3]
    _assert_examples(src, _brute_examples([docs[i].tolist() for i in keep], [sups[i].tolist() for i in keep], 1, 7,
                                          0, True))
    # Plain records: the loss mask is the next-token mask (the original layout reads as before).
    plain = str(tmp_path / "plain.array_record")
    write_pretokenized(plain, docs)
    p = ExampleSource.open(plain, None, seq_len=7, seed=1)
    _assert_examples(p, _brute_examples([x.tolist() for x in docs], [[1] * len(x) for x in docs], 1, 7, 0, True))
    # One layout per data set; flags are 0/1 of the document's length.
    mixed = tmp_path / "mixed"
    write_pretokenized(str(mixed / "a.array_record"), docs[:1], supervised=sups[:1])
    write_pretokenized(str(mixed / "b.array_record"), docs[1:])
    with pytest.raises(InputError, match="b.array_record record 0: a plain record in a data set of supervised"):
        ExampleSource.open(str(mixed), None, seq_len=7)
    with pytest.raises(InputError, match="supervision flags"):
        write_pretokenized(str(tmp_path / "x.array_record"), docs[:1], supervised=[np.array([2, 0, 0, 0, 0])])
    from array_record.python.array_record_module import ArrayRecordWriter

    from logit_distill.data.pretokenized import MAGIC

    w = ArrayRecordWriter(str(tmp_path / "short.array_record"), "group_size:1")
    w.write(MAGIC + np.array([3], "<u4").tobytes() + b"\0" * 8)
    w.close()
    with pytest.raises(InputError, match="short.array_record record 0: supervised record of 16 bytes"):
        ExampleSource.open(str(tmp_path / "short.array_record"), None, seq_len=7)


# ----------------------------------------------------------------------------- options


def test_options_and_template_kwargs():
    assert parse_template_kwargs(["enable_thinking=false", "n=3", "name=Bob", "xs=[1, 2]", 'q="a=b"']) == {
        "enable_thinking": False, "n": 3, "name": "Bob", "xs": [1, 2], "q": "a=b"}
    with pytest.raises(InputError, match="NAME=VALUE"):
        parse_template_kwargs(["enable_thinking"])
    bad = [dict(format="chat"), dict(mask_method="diff"), dict(supervise_roles=("robot",)),
           dict(supervise_roles=("assistant", "user"), mask_method="generation"), dict(now="yesterday"),
           dict(template_kwargs={"messages": []}), dict(template_kwargs={"x": float("nan")}),
           dict(reasoning_tags=("<think>",)), dict(messages_field=""), dict(supervise_end_of_turn="yes")]
    for kw in bad:
        with pytest.raises(InputError):
            ChatOptions(**kw).check()
    assert ChatOptions().check() == ChatOptions()


# ----------------------------------------------------------------------------- bad input


def _bad(tmp_path, tok_dir, records=None, *, path=None, chat=None, message, planned=False):
    """`ExampleSource.open` refuses with one line naming the problem and leaves no token cache behind;
    with `planned`, `plan_identity` refuses too (a problem it can see without tokenizing)."""
    data = path or _write_jsonl(tmp_path / "bad.jsonl", records)
    cache = str(tmp_path / "cache")
    calls = [lambda: ExampleSource.open(data, tok_dir, seq_len=16, chat=chat, cache_dir=cache)]
    if planned:
        calls.append(lambda: plan_identity(data, tok_dir, seq_len=16, chat=chat, cache_dir=cache))
    for call in calls:
        with pytest.raises(InputError) as e:
            call()
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    tokens = os.path.join(cache, "tokens")
    assert not os.path.isdir(tokens) or not os.listdir(tokens)


def test_bad_conversations(tok_dirs, tmp_path):
    d = tok_dirs["chatml_think_tools"]
    ok = {"messages": CONVERSATIONS["simple"]}
    _bad(tmp_path, d, [ok, {"messages": [{"content": "hi"}]}], message="bad.jsonl:2: messages[0] has no 'role'")
    _bad(tmp_path, d, [ok, {"messages": [{"role": "user"}]}], message="messages[0] (user) has no 'content'")
    _bad(tmp_path, d, [ok, {"messages": [{"role": "robot", "content": "x"}]}],
         message="messages[0] has role 'robot', not one of")
    _bad(tmp_path, d, [ok, {"messages": "hello"}], message="field 'messages' is a str, not a list of messages")
    _bad(tmp_path, d, [ok, {"text": "plain"}], message="bad.jsonl:2: a text record in a data set of messages records")
    _bad(tmp_path, d, [{"prompt": "a", "completion": "b"}, {"prompt": [CONVERSATIONS["simple"][1]],
                                                           "completion": [CONVERSATIONS["simple"][2]]}],
         message="prompt/completion of another kind than the first record's (strings)")
    _bad(tmp_path, d, [{"body": "x"}], message="bad.jsonl:1: neither 'messages', 'prompt' + 'completion' nor 'text'",
         planned=True)
    _bad(tmp_path, d, [ok], chat=ChatOptions(format="prompt_completion"), message="bad.jsonl:1: no field 'prompt'")


def test_bad_templates(tok_dirs, tmp_path):
    gemma = tok_dirs["gemma_fold_system"]
    wrong_order = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    _bad(tmp_path, gemma, [wrong_order], message="bad.jsonl:1: the chat template raised: Conversation roles must "
                                                 "alternate user/assistant/user/assistant/...")
    no_template = write_chat_tokenizer(tmp_path / "none", where="none")
    _bad(tmp_path, no_template, [{"messages": CONVERSATIONS["simple"]}],
         message="holds conversations but there is no chat template next to", planned=True)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    _bad(tmp_path, gemma, [{"messages": CONVERSATIONS["simple"]}], chat=ChatOptions(chat_template=str(broken)),
         message=f"chat template {broken}: line 1:", planned=True)
    _bad(tmp_path, gemma, [{"messages": CONVERSATIONS["simple"]}], chat=ChatOptions(mask_method="generation"),
         message="has no {% generation %} markers", planned=True)
    # A template that rewrites earlier turns in another way than dropping their reasoning.
    counting = tmp_path / "counting.jinja"
    counting.write_text("{{- messages|length }} messages\n{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + "
                        "m.content + '<|im_end|>\\n' }}{% endfor %}{%- if add_generation_prompt %}"
                        "{{ '<|im_start|>assistant\\n' }}{% endif %}")
    _bad(tmp_path, gemma, [{"messages": CONVERSATIONS["multi"]}], chat=ChatOptions(chat_template=str(counting)),
         message="renders the conversation before turn 1 (assistant) differently once later turns follow")


def test_bad_parquet(tok_dirs, tmp_path):
    d = tok_dirs["chatml_think_tools"]
    path = _write_parquet(tmp_path / "p.parquet", [{"msgs": CONVERSATIONS["simple"]}])
    _bad(tmp_path, d, path=path, message="p.parquet: neither 'messages', 'prompt' + 'completion' nor 'text' "
                                         "(fields: ['msgs'])", planned=True)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    _write_parquet(mixed / "a.parquet", [{"messages": CONVERSATIONS["simple"]}])
    _write_parquet(mixed / "b.parquet", [{"text": "hello"}])
    _bad(tmp_path, d, path=str(mixed), message="b.parquet: columns ['text'] make it a text file in a data set of "
                                               "messages files")
    both = tmp_path / "both"
    both.mkdir()
    _write_parquet(both / "a.parquet", [{"text": "hello"}])
    _write_jsonl(both / "b.jsonl", [{"text": "hello"}])
    _bad(tmp_path, d, path=str(both), message="mixes JSONL and Parquet files", planned=True)
    notpq = tmp_path / "x.parquet"
    notpq.write_bytes(b"PAR1 not really")
    _bad(tmp_path, d, path=str(notpq), message="x.parquet: not a readable Parquet file", planned=True)


def _bad_inputs(tok_dirs, tmp_path) -> dict:
    """Deliver 6's bad inputs: case -> (tokenizer, data, extra flags, what the line names)."""
    chatml, gemma = tok_dirs["chatml_think_tools"], tok_dirs["gemma_fold_system"]
    ok = {"messages": CONVERSATIONS["simple"]}
    jsonl = lambda name, records: _write_jsonl(tmp_path / f"{name}.jsonl", records)  # noqa: E731
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    _write_jsonl(mixed / "a.jsonl", [ok])
    _write_jsonl(mixed / "b.jsonl", [{"text": "plain"}])
    raising = tmp_path / "raising.jinja"
    raising.write_text("{{ raise_exception('this template takes no ' + messages[0].role + ' turn') }}")
    return {
        "no role": (chatml, jsonl("no-role", [ok, {"messages": [{"content": "hi"}]}]), [],
                    "no-role.jsonl:2: messages[0] has no 'role'"),
        "no content": (chatml, jsonl("no-content", [ok, {"messages": [{"role": "user"}]}]), [],
                       "messages[0] (user) has no 'content'"),
        "unknown role": (chatml, jsonl("robot", [ok, {"messages": [{"role": "robot", "content": "x"}]}]), [],
                         "messages[0] has role 'robot', not one of"),
        "template raises": (gemma, jsonl("order", [ok, {"messages": [{"role": "user", "content": "a"},
                                                                     {"role": "user", "content": "b"}]}]), [],
                            "order.jsonl:2: the chat template raised: Conversation roles must alternate"),
        "raise_exception": (chatml, jsonl("raising", [ok]), ["--chat-template", str(raising)],
                            "the chat template raised: this template takes no system turn"),
        "no template": (write_chat_tokenizer(tmp_path / "none", where="none"), jsonl("no-template", [ok]), [],
                        "holds conversations but there is no chat template next to"),
        "parquet without the column": (chatml, _write_parquet(tmp_path / "p.parquet", [{"msgs": ok["messages"]}]),
                                       [], "p.parquet: neither 'messages', 'prompt' + 'completion' nor 'text'"),
        "mixed formats": (chatml, str(mixed), [], "b.jsonl:1: a text record in a data set of messages records"),
    }


def test_bad_chat_input_is_one_line_exit_2_and_nothing_written(tok_dirs, tmp_path, capsys):
    from logit_distill.cli import main

    for case, (tok, data, flags, message) in _bad_inputs(tok_dirs, tmp_path).items():
        out = tmp_path / "store"
        code = main(["dump", "--teacher", "preset:tiny-qwen3", "--tokenizer", tok, "--data", data,
                     "--output", str(out), "--num-steps", "1", "--seq-len", "16", "--batch-size", "1", *flags])
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and "Traceback" not in err, (case, err)
        assert lines[-1].startswith("logit-distill dump: error: ") and message in lines[-1], (case, lines[-1])
        assert not out.exists(), case
