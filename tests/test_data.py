"""Tests of logit_distill.data: tokenization, token cache, deterministic packed order, errors.

The tokenizer is a tiny byte-level BPE built here (no merges, byte b -> id b, `<|endoftext|>` = 256),
so the expected token ids of a text are simply its UTF-8 bytes.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import pickle
import random
import threading

import numpy as np
import pytest

from logit_distill.data import ExampleSource, InputError, load_tokenizer, write_pretokenized
from logit_distill.errors import InputError as BaseInputError

EOS = 256
MASK64 = (1 << 64) - 1


# ----------------------------------------------------------------------------- fixtures


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _write_tokenizer(directory, *, tokenizer_config=True, config=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    b2u = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={b2u[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    if tokenizer_config:
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": "<|endoftext|>", "bos_token": None}, f)
    if config is not None:
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(config, f)
    return str(directory)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return _write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture()
def cache(tmp_path):
    return str(tmp_path / "cache")


def _texts(n=40, seed=0):
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "délta", "ε", "zeta!", "\n", "  "]
    out = []
    for _ in range(n):
        k = rng.choice([0, 1, 2, 3, 5, 9, 14])
        out.append(" ".join(rng.choice(words) for _ in range(k)))
    return out


def _write_jsonl(path, texts, field="text"):
    with open(path, "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({field: t, "id": i}) + "\n")
    return str(path)


# ----------------------------------------------------------------------------- brute force (independent)


def _py_splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def _py_order(n: int, seed: int) -> list[int]:
    m = _py_splitmix64(seed)
    return sorted(range(n), key=lambda d: _py_splitmix64(d ^ m))


def _brute_packed(docs: list[list[int]], seed: int, L: int, pad: int):
    stream, seg, pos = [], [], []
    for d in _py_order(len(docs), seed):
        stream += docs[d]
        seg += [d] * len(docs[d])  # document id for now
        pos += list(range(len(docs[d])))
    out = []
    for s in range(0, len(stream), L):
        t, g = stream[s : s + L], seg[s : s + L]
        sid, p, cur, prev = [], [], 0, None
        for j, doc in enumerate(g):
            if doc != prev:
                cur, start, prev = cur + 1, j, doc
            sid.append(cur)
            p.append(j - start)
        padn = L - len(t)
        out.append((t + [pad] * padn, sid + [0] * padn, p + [0] * padn))
    return out


def _brute_unpacked(docs, seed, L, pad):
    out = []
    for d in _py_order(len(docs), seed):
        doc = docs[d]
        for s in range(0, len(doc), L):
            t = doc[s : s + L]
            padn = L - len(t)
            out.append((t + [pad] * padn, [1] * len(t) + [0] * padn, list(range(len(t))) + [0] * padn))
    return out


def _text_docs(texts):
    return [list(t.encode("utf-8")) + [EOS] for t in texts if t]


def _assert_matches(src, expected):
    assert len(src) == len(expected)
    for i, (t, s, p) in enumerate(expected):
        ex = src[i]
        assert set(ex) == {"tokens", "segment_ids", "positions", "loss_mask"}
        for k in ("tokens", "segment_ids", "positions"):
            assert ex[k].dtype == np.int32 and ex[k].shape == (src.seq_len,)
        # Text: the loss mask is the next-token mask of the segments (same segment, not padding).
        want = [s[j] != 0 and j + 1 < len(s) and s[j + 1] == s[j] for j in range(len(s))]
        assert ex["loss_mask"].dtype == bool and ex["loss_mask"].tolist() == want, f"loss_mask of example {i}"
        np.testing.assert_array_equal(ex["tokens"], t, err_msg=f"tokens of example {i}")
        np.testing.assert_array_equal(ex["segment_ids"], s, err_msg=f"segment_ids of example {i}")
        np.testing.assert_array_equal(ex["positions"], p, err_msg=f"positions of example {i}")


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer(tok_dir, tmp_path):
    tok = load_tokenizer(tok_dir)
    assert tok.vocab_size == 257 and tok.eos_id == EOS
    assert tok.encode("héllo wörld") == list("héllo wörld".encode())
    with open(os.path.join(tok_dir, "tokenizer.json"), "rb") as f:
        assert tok.identity == hashlib.sha256(f.read()).hexdigest()
    assert load_tokenizer(os.path.join(tok_dir, "tokenizer.json")).identity == tok.identity
    tok.check_vocab(257)
    with pytest.raises(InputError, match="257"):
        tok.check_vocab(256)

    # EOS from config.json when there is no tokenizer_config.json (a list: the first id).
    d2 = _write_tokenizer(tmp_path / "t2", tokenizer_config=False, config={"eos_token_id": [97, 98]})
    assert load_tokenizer(d2).eos_id == 97
    d3 = _write_tokenizer(tmp_path / "t3", tokenizer_config=False)
    with pytest.raises(InputError, match="EOS"):
        load_tokenizer(d3)
    with pytest.raises(InputError, match="not found"):
        load_tokenizer(str(tmp_path / "nope"))


# ----------------------------------------------------------------------------- order, packing


@pytest.mark.parametrize("seed,L", [(0, 16), (7, 5), (123456789012345, 64)])
def test_packed_matches_brute_force(tok_dir, tmp_path, cache, seed, L):
    texts = _texts(40) + ["x" * 50, ""]  # one document longer than any L; one empty text (skipped)
    data = _write_jsonl(tmp_path / "d.jsonl", texts)
    src = ExampleSource.open(data, tok_dir, seq_len=L, seed=seed, cache_dir=cache)
    docs = _text_docs(texts)
    _assert_matches(src, _brute_packed(docs, seed, L, EOS))
    assert src.num_documents == len(docs) and src.num_tokens == sum(map(len, docs))
    assert src.vocab_size == 257 and src.eos_id == EOS
    # Seeking: numpy ints, negative indices, out of range.
    np.testing.assert_array_equal(src[np.int64(3)]["tokens"], src[3]["tokens"])
    np.testing.assert_array_equal(src[-1]["tokens"], src[len(src) - 1]["tokens"])
    with pytest.raises(IndexError):
        src[len(src)]
    with pytest.raises(IndexError):
        src[-len(src) - 1]
    b = src.batch(np.array([2, 0, 2]))
    assert b["tokens"].shape == (3, L) and b["tokens"].dtype == np.int32
    np.testing.assert_array_equal(b["positions"][1], src[0]["positions"])


def test_segments_and_positions(tok_dir, tmp_path, cache):
    # Three documents of 3, 5 and 9 tokens (with EOS), L = 6.
    texts = ["ab", "abcd", "abcdefgh"]
    data = _write_jsonl(tmp_path / "d.jsonl", texts)
    src = ExampleSource.open(data, tok_dir, seq_len=6, seed=1, cache_dir=cache)
    assert len(src) == 3  # ceil(17 / 6): the last example is padded
    seen_tokens = []
    for i in range(len(src)):
        ex = src[i]
        seg, pos = ex["segment_ids"], ex["positions"]
        assert seg[0] == 1 and pos[0] == 0  # a cut document continues as segment 1 from position 0
        real = seg > 0
        for j in range(1, 6):
            if seg[j] == 0:
                assert pos[j] == 0 and ex["tokens"][j] == EOS
            elif seg[j] == seg[j - 1]:
                assert pos[j] == pos[j - 1] + 1
            else:
                assert seg[j] == seg[j - 1] + 1 and pos[j] == 0
        seen_tokens += list(ex["tokens"][real])
    assert seen_tokens.count(EOS) == 3 and len(seen_tokens) == 17
    assert src[2]["segment_ids"].tolist()[-1] == 0


def test_no_packing(tok_dir, tmp_path, cache):
    texts = _texts(30, seed=3) + ["y" * 23]
    data = _write_jsonl(tmp_path / "d.jsonl", texts)
    src = ExampleSource.open(data, tok_dir, seq_len=8, packing=False, seed=5, cache_dir=cache)
    docs = _text_docs(texts)
    _assert_matches(src, _brute_unpacked(docs, 5, 8, EOS))
    assert len(src) == sum(-(-len(d) // 8) for d in docs)  # long documents become several examples
    assert src.identity["packing"] is False


def test_determinism_and_identity(tok_dir, tmp_path):
    data = _write_jsonl(tmp_path / "d.jsonl", _texts(50))
    c1, c2 = str(tmp_path / "c1"), str(tmp_path / "c2")
    a = ExampleSource.open(data, tok_dir, seq_len=12, seed=9, cache_dir=c1)
    b = ExampleSource.open(data, tok_dir, seq_len=12, seed=9, cache_dir=c2)
    ab = a.batch(range(len(a)))
    bb = b.batch(range(len(b)))
    for k in ab:
        assert ab[k].tobytes() == bb[k].tobytes()
    assert a.identity == b.identity
    import shutil

    shutil.rmtree(c1)
    c = ExampleSource.open(data, tok_dir, seq_len=12, seed=9, cache_dir=c1)
    assert c.batch(range(len(c)))["tokens"].tobytes() == ab["tokens"].tobytes()
    for key in ("data_sha256", "tokenizer_sha256", "text_field", "seed", "seq_len", "packing", "num_documents",
                "num_tokens", "eos_id"):
        assert key in a.identity
    json.dumps(a.identity)  # goes into the store manifest
    other = ExampleSource.open(data, tok_dir, seq_len=12, seed=10, cache_dir=c1)
    assert other.batch(range(len(other)))["tokens"].tobytes() != ab["tokens"].tobytes()
    assert other.identity["data_sha256"] == a.identity["data_sha256"]
    # Different content -> different data identity.
    data2 = _write_jsonl(tmp_path / "e.jsonl", _texts(50)[:-1] + ["changed"])
    assert ExampleSource.open(data2, tok_dir, seq_len=12, cache_dir=c1).identity["data_sha256"] != a.identity["data_sha256"]


def test_pickle_reopens_memory_map(tok_dir, tmp_path, cache):
    data = _write_jsonl(tmp_path / "d.jsonl", _texts(20))
    src = ExampleSource.open(data, tok_dir, seq_len=10, cache_dir=cache)
    blob = pickle.dumps(src)
    clone = pickle.loads(blob)
    assert len(clone) == len(src) and clone.identity == src.identity
    np.testing.assert_array_equal(clone[len(src) - 1]["tokens"], src[len(src) - 1]["tokens"])

    import grain

    ds = grain.MapDataset.source(src)
    np.testing.assert_array_equal(ds[1]["tokens"], src[1]["tokens"])


# ----------------------------------------------------------------------------- inputs


def test_directory_glob_and_gzip(tok_dir, tmp_path, cache):
    t1, t2, t3 = _texts(10, 1), _texts(10, 2), _texts(10, 3)
    d = tmp_path / "dir"
    d.mkdir()
    _write_jsonl(d / "b.jsonl", t2)
    _write_jsonl(d / "a.jsonl", t1)
    (d / "README.txt").write_text("ignored")
    _write_jsonl(d / "c.jsonl.tmp", ["ignored"])  # not a data file name: ignored
    (d / "sub").mkdir()
    _write_jsonl(d / "sub" / "c.jsonl", ["not searched"])
    # The directory: files sorted by name (a, b); documents in file order before the shuffle.
    src = ExampleSource.open(str(d), tok_dir, seq_len=7, seed=2, cache_dir=cache)
    _assert_matches(src, _brute_packed(_text_docs(t1 + t2), 2, 7, EOS))
    g = ExampleSource.open(f"file://{d}/*.jsonl", tok_dir, seq_len=7, seed=2, cache_dir=cache)
    assert g.identity["data_sha256"] == src.identity["data_sha256"]
    # gzip-compressed JSONL with another text field.
    gz = tmp_path / "z.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        for t in t3:
            f.write(json.dumps({"body": t}) + "\n")
    z = ExampleSource.open(str(gz), tok_dir, seq_len=7, seed=2, cache_dir=cache, text_field="body")
    _assert_matches(z, _brute_packed(_text_docs(t3), 2, 7, EOS))


def test_pretokenized_array_record(tok_dir, tmp_path, cache):
    rng = np.random.default_rng(0)
    docs_a = [rng.integers(0, 200, size=rng.integers(1, 30)) for _ in range(12)]
    docs_b = [rng.integers(0, 250, size=rng.integers(1, 30)).astype(np.int64) for _ in range(7)]
    d = tmp_path / "pre"
    write_pretokenized(str(d / "part-0.array_record"), docs_a)
    write_pretokenized(f"file://{d}/part-1.array_record", docs_b + [np.zeros(0, np.int32)])  # empty doc skipped
    assert not [p for p in os.listdir(d) if p.startswith(".tmp")]
    docs = [list(map(int, x)) for x in docs_a + docs_b]  # records are used verbatim (no EOS added)
    src = ExampleSource.open(str(d), None, seq_len=16, seed=4, cache_dir=cache)
    assert src.eos_id is None and src.vocab_size == max(max(x) for x in docs) + 1
    _assert_matches(src, _brute_packed(docs, 4, 16, 0))
    assert src.identity["data_kind"] == "array_record" and src.identity["tokenizer_sha256"] is None
    # With the tokenizer: its vocabulary and EOS (the pad token).
    st = ExampleSource.open(str(d), tok_dir, seq_len=16, packing=False, seed=4, cache_dir=cache)
    assert st.vocab_size == 257 and st.eos_id == EOS
    _assert_matches(st, _brute_unpacked(docs, 4, 16, EOS))
    st.check_vocab(300)
    with pytest.raises(InputError):
        st.check_vocab(250)

    # Ids outside the tokenizer's vocabulary.
    write_pretokenized(str(tmp_path / "big.array_record"), [np.array([1, 2, 999])])
    with pytest.raises(InputError, match="999"):
        ExampleSource.open(str(tmp_path / "big.array_record"), tok_dir, seq_len=4, cache_dir=cache)
    # A record that is not int32 little-endian.
    from array_record.python.array_record_module import ArrayRecordWriter

    w = ArrayRecordWriter(str(tmp_path / "bad.array_record"), "group_size:1")
    w.write(b"\x01\x00\x00\x00\x02")
    w.close()
    with pytest.raises(InputError, match="bad.array_record record 0"):
        ExampleSource.open(str(tmp_path / "bad.array_record"), None, seq_len=4, cache_dir=cache)


# ----------------------------------------------------------------------------- the cache


def test_cache_reuse(tok_dir, tmp_path, cache, monkeypatch):
    data = _write_jsonl(tmp_path / "d.jsonl", _texts(30))
    a = ExampleSource.open(data, tok_dir, seq_len=8, cache_dir=cache)
    tok_root = os.path.join(cache, "tokens")
    (key,) = [p for p in os.listdir(tok_root)]  # one built cache, no temporary left over
    files = {f: os.stat(os.path.join(tok_root, key, f)).st_mtime_ns for f in ("tokens.i32", "offsets.npy", "meta.json")}

    from logit_distill.data import inputs, tokenizer

    def boom(*a, **k):
        raise AssertionError("re-tokenized or re-hashed")

    monkeypatch.setattr(tokenizer.Tokenizer, "encode_batch", boom)
    monkeypatch.setattr(inputs, "_sha256_stream", boom)
    b = ExampleSource.open(data, tok_dir, seq_len=8, seed=3, packing=False, cache_dir=cache)  # other order: same cache
    assert {f: os.stat(os.path.join(tok_root, key, f)).st_mtime_ns for f in files} == files
    assert b.num_tokens == a.num_tokens
    monkeypatch.undo()

    # A changed file is re-hashed and re-tokenized into a new cache entry.
    _write_jsonl(tmp_path / "d.jsonl", _texts(30)[:-1] + ["new text"])
    c = ExampleSource.open(data, tok_dir, seq_len=8, cache_dir=cache)
    assert c.identity["data_sha256"] != a.identity["data_sha256"]
    assert len(os.listdir(tok_root)) == 2

    # A damaged cache is detected and rebuilt.
    with open(os.path.join(tok_root, key, "tokens.i32"), "ab") as f:
        f.write(b"\0\0\0\0")
    _write_jsonl(tmp_path / "d.jsonl", _texts(30))  # back to the first content (new mtime: re-hashed)
    d = ExampleSource.open(data, tok_dir, seq_len=8, cache_dir=cache)
    assert d.batch(range(len(d)))["tokens"].tobytes() == a.batch(range(len(a)))["tokens"].tobytes()


def test_concurrent_build(tok_dir, tmp_path, cache):
    data = _write_jsonl(tmp_path / "d.jsonl", _texts(200))
    results, errors = [], []

    def run():
        try:
            s = ExampleSource.open(data, tok_dir, seq_len=32, cache_dir=cache)
            results.append(s.batch(range(len(s)))["tokens"].tobytes())
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert len(os.listdir(os.path.join(cache, "tokens"))) == 1


# ----------------------------------------------------------------------------- errors


def test_input_errors(tok_dir, tmp_path, cache):
    assert issubclass(InputError, BaseInputError) and issubclass(InputError, ValueError)
    good = _write_jsonl(tmp_path / "good.jsonl", ["hello"])

    with pytest.raises(InputError, match="not found"):
        ExampleSource.open(str(tmp_path / "missing.jsonl"), tok_dir, seq_len=8, cache_dir=cache)
    with pytest.raises(InputError, match="no files match"):
        ExampleSource.open(str(tmp_path / "nothing-*.jsonl"), tok_dir, seq_len=8, cache_dir=cache)
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(InputError, match="no \\*.jsonl"):
        ExampleSource.open(str(tmp_path / "emptydir"), tok_dir, seq_len=8, cache_dir=cache)

    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    with pytest.raises(InputError, match="no documents"):
        ExampleSource.open(str(blank), tok_dir, seq_len=8, cache_dir=cache)
    empties = _write_jsonl(tmp_path / "empties.jsonl", ["", ""])
    with pytest.raises(InputError, match="no documents"):
        ExampleSource.open(empties, tok_dir, seq_len=8, cache_dir=cache)

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n\n{"text": "b"\n')
    with pytest.raises(InputError, match=r"bad\.jsonl:3: not valid JSON"):
        ExampleSource.open(str(bad), tok_dir, seq_len=8, cache_dir=cache)
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"text": "a"}\n{"content": "b"}\n')
    with pytest.raises(InputError, match=r"nofield\.jsonl:2: no field 'text'"):
        ExampleSource.open(str(nofield), tok_dir, seq_len=8, cache_dir=cache)
    notstr = tmp_path / "notstr.jsonl"
    notstr.write_text('{"text": 3}\n')
    with pytest.raises(InputError, match=r"notstr\.jsonl:1"):
        ExampleSource.open(str(notstr), tok_dir, seq_len=8, cache_dir=cache)
    notobj = tmp_path / "notobj.jsonl"
    notobj.write_text('["text"]\n')
    with pytest.raises(InputError, match=r"notobj\.jsonl:1: expected a JSON object"):
        ExampleSource.open(str(notobj), tok_dir, seq_len=8, cache_dir=cache)
    assert not [p for p in os.listdir(os.path.join(cache, "tokens")) if p.startswith(".tmp")]

    for L in (1, 0, -4, 2.5, True):
        with pytest.raises(InputError, match="seq_len"):
            ExampleSource.open(good, tok_dir, seq_len=L, cache_dir=cache)
    with pytest.raises(InputError, match="seed"):
        ExampleSource.open(good, tok_dir, seq_len=8, seed=-1, cache_dir=cache)
    with pytest.raises(InputError, match="tokenizer"):
        ExampleSource.open(good, None, seq_len=8, cache_dir=cache)

    src = ExampleSource.open(good, tok_dir, seq_len=2, cache_dir=cache)
    assert len(src) == 3  # "hello" + EOS = 6 tokens
    src.check_vocab(257)
    with pytest.raises(InputError, match="vocabulary"):
        src.check_vocab(200)

    (tmp_path / "mixed").mkdir()
    _write_jsonl(tmp_path / "mixed" / "a.jsonl", ["x"])
    write_pretokenized(str(tmp_path / "mixed" / "b.array_record"), [np.array([1])])
    with pytest.raises(InputError, match="mixes"):
        ExampleSource.open(str(tmp_path / "mixed"), tok_dir, seq_len=8, cache_dir=cache)
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(InputError, match="unknown data file type"):
        ExampleSource.open(str(tmp_path / "x.txt"), tok_dir, seq_len=8, cache_dir=cache)


# ----------------------------------------------------------------------------- remote file systems


def test_remote_fsspec_paths(tok_dir, cache):
    """Non-local inputs (fsspec memory://): objects are hashed by reading, ArrayRecord copied locally."""
    import fsspec

    fs = fsspec.filesystem("memory")
    try:
        write_pretokenized("memory://bkt/pre/a.array_record", [np.arange(5), np.arange(3) + 10])
        src = ExampleSource.open("memory://bkt/pre", None, seq_len=4, cache_dir=cache)
        _assert_matches(src, _brute_packed([list(range(5)), [10, 11, 12]], 0, 4, 0))
        with fs.open("/bkt/t/a.jsonl", "wb") as f:
            f.write(b'{"text": "hi there"}\n{"text": "x"}\n')
        t = ExampleSource.open("memory://bkt/t/*.jsonl", tok_dir, seq_len=4, cache_dir=cache)
        _assert_matches(t, _brute_packed(_text_docs(["hi there", "x"]), 0, 4, EOS))
    finally:
        fs.rm("/bkt", recursive=True)


def test_gcs_emulator(tok_dir, cache, monkeypatch):
    """gs:// through gcsfs against a real GCS emulator on loopback: object hashes come from fs.info."""
    pytest.importorskip("gcp_storage_emulator")
    import socket
    import subprocess
    import sys
    import time

    import gcsfs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.time() < deadline, "GCS emulator did not start"
                time.sleep(0.1)
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        gcsfs.GCSFileSystem.clear_instance_cache()
        fs = gcsfs.GCSFileSystem(token="anon", project="test")
        fs.mkdir("bkt")
        docs = [np.arange(5), np.arange(3) + 10, np.arange(7) + 100]
        write_pretokenized("gs://bkt/pre/a.array_record", docs)
        assert fs.info("bkt/pre/a.array_record").get("md5Hash")
        src = ExampleSource.open("gs://bkt/pre", None, seq_len=4, seed=1, cache_dir=cache)
        _assert_matches(src, _brute_packed([list(map(int, d)) for d in docs], 1, 4, 0))
        with fs.open("bkt/t/a.jsonl", "wb") as f:
            f.write(b'{"text": "hi there"}\n{"text": "x"}\n')
        t = ExampleSource.open("gs://bkt/t/a.jsonl", tok_dir, seq_len=4, cache_dir=cache)
        _assert_matches(t, _brute_packed(_text_docs(["hi there", "x"]), 0, 4, EOS))
    finally:
        gcsfs.GCSFileSystem.clear_instance_cache()
        proc.terminate()
        proc.wait(timeout=10)
