"""The store on local disk and on a real GCS emulator: manifest, scan, writer, reader, errors."""

import json

import numpy as np
import pytest

from logit_distill import codec, paths, store
from logit_distill.errors import ConfigMismatchError, StoreError
from store_helpers import small_manifest, write_store


def _expected(written, manifest, index):
    layout = manifest["layout"]
    b = layout["examples_per_step"] // layout["num_processes"]
    step, r = divmod(index, layout["examples_per_step"])
    p, o = divmod(r, b)
    recs = written[(step, p)]
    return {k: v[o] for k, v in recs.items()}


@pytest.mark.parametrize("codec_name", ["exact", "default"])
def test_round_trip(store_root, codec_name):
    m = small_manifest(codec=codec_name, num_processes=2)
    uri = store_root + "/rt"
    written = write_store(uri, m)
    s = store.open_store(uri)
    assert s.manifest["fingerprint"] == m["fingerprint"]
    assert s.num_examples == len(s) == 5 * 4
    assert s.complete
    for i in range(len(s)):
        got, want = s.read(i), _expected(written, m, i)
        assert int(got["example_index"]) == i
        for key in ("tokens", "segment_ids", "positions", "topk_ids"):
            np.testing.assert_array_equal(got[key], want[key])
        tol = 0 if codec_name == "exact" else codec.LOGPROB_MAX_ERROR
        assert np.abs(got["topk_logprobs"] - want["topk_logprobs"]).max() <= tol
        assert np.abs(got["tail_logprob"] - want["tail_logprob"]).max() <= tol
        assert got["topk_logprobs"].dtype == np.float32 and got["topk_ids"].dtype == np.int32
    s.close()


def test_same_inputs_same_bytes(tmp_path):
    m = small_manifest()
    write_store(str(tmp_path / "a"), m)
    write_store(str(tmp_path / "b"), m)
    a = sorted(p.name for p in (tmp_path / "a").iterdir())
    b = sorted(p.name for p in (tmp_path / "b").iterdir())
    assert a == b  # names carry the checksums
    for name in a:
        if name != "manifest.json":
            assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_manifest_fields_and_fingerprint():
    m = small_manifest(vocab_size=151936, top_k=64, seq_len=2048)
    assert m["format_version"] == store.FORMAT_VERSION
    assert m["shapes"] == {"seq_len": 2048, "top_k": 64, "vocab_size": 151936}
    assert m["codec"]["name"] == "default" and m["codec"]["id_bits"] == 18
    assert set(m["layout"]) == {"num_steps", "examples_per_step", "steps_per_file", "num_processes"}
    assert m["fingerprint"] == store.fingerprint_of(m)
    other = small_manifest(vocab_size=151936, top_k=32, seq_len=2048)
    assert other["fingerprint"] != m["fingerprint"]
    assert store.diff_manifests(m, other) == ["shapes.top_k: store has 64, this run has 32"]
    # Creation time is not part of the identity.
    again = small_manifest(vocab_size=151936, top_k=64, seq_len=2048)
    assert again["fingerprint"] == m["fingerprint"]


def test_scan_finds_gaps_leftovers_and_foreign_chunks(store_root):
    m = small_manifest(num_steps=7, steps_per_file=2)
    uri = store_root + "/scan"
    write_store(uri, m, steps=[0, 1, 4, 5])
    other = small_manifest(num_steps=7, steps_per_file=2, teacher="another")
    other_uri = store_root + "/other"
    write_store(other_uri, other, steps=[2, 3])
    foreign_name = paths.list_files(other_uri)
    foreign_name = [f["name"] for f in foreign_name if f["name"].startswith("chunk-")][0]
    paths.write_bytes_atomic(paths.join(uri, foreign_name), paths.read_bytes(paths.join(other_uri, foreign_name)))
    paths.write_bytes_atomic(paths.join(uri, "notes.txt"), b"hello")
    result = store.scan(uri, m)
    assert sorted(result.chunks) == [(0, 0, 2), (0, 4, 6)]
    assert result.missing == {0: [(2, 4), (6, 7)]}
    assert result.first_missing_step(0) == 2
    assert [c.name for c in result.foreign] == [foreign_name]
    assert result.leftovers == ["notes.txt"]
    assert not result.complete
    assert result.num_expected == 4 and result.num_present == 2
    s = store.open_store(uri)
    assert s.num_examples == 4 * 4 and not s.complete
    s.read(0)
    with pytest.raises(StoreError, match=r"steps \[2, 4\), whose chunk is not committed"):
        s.read(2 * 4)


def test_local_leftover_temporary_files_are_reported(tmp_path):
    m = small_manifest()
    uri = str(tmp_path / "s")
    write_store(uri, m)
    (tmp_path / "s" / ".tmp-abc-chunk.array_record").write_bytes(b"partial")
    assert store.scan(uri, m).leftovers == [".tmp-abc-chunk.array_record"]
    assert store.scan(uri, m).complete


def _first_chunk(uri):
    return sorted(f["name"] for f in paths.list_files(uri) if f["name"].startswith("chunk-"))[0]


def test_flipped_byte_is_detected_and_named(store_root):
    m = small_manifest()
    uri = store_root + "/flip"
    write_store(uri, m)
    name = _first_chunk(uri)
    data = bytearray(paths.read_bytes(paths.join(uri, name)))
    data[len(data) // 3] ^= 0x40
    paths.write_bytes_atomic(paths.join(uri, name), bytes(data))
    s = store.open_store(uri)
    with pytest.raises(StoreError, match=f"{name}: checksum mismatch"):
        s.read(0)


def test_truncated_chunk_is_detected_and_named(store_root):
    m = small_manifest()
    uri = store_root + "/trunc"
    write_store(uri, m)
    name = _first_chunk(uri)
    data = paths.read_bytes(paths.join(uri, name))
    paths.write_bytes_atomic(paths.join(uri, name), data[: len(data) // 2])
    s = store.open_store(uri)
    with pytest.raises(StoreError, match=f"{name}: checksum mismatch.*truncated"):
        s.read(0)


def test_not_a_store(store_root, tmp_path):
    with pytest.raises(StoreError, match="is not a logit store: it does not exist"):
        store.open_store(store_root + "/nothing-here")
    d = tmp_path / "plain"
    d.mkdir()
    (d / "x.txt").write_text("x")
    with pytest.raises(StoreError, match=f"{d} is not a logit store: it holds no manifest.json"):
        store.open_store(str(d))


def test_unknown_format_version(store_root):
    m = small_manifest()
    uri = store_root + "/v"
    write_store(uri, m)
    bad = dict(m, format_version=99)
    paths.write_bytes_atomic(paths.join(uri, "manifest.json"), json.dumps(bad).encode())
    with pytest.raises(StoreError, match=r"manifest.json: unknown store format version 99"):
        store.open_store(uri)


def test_edited_manifest_is_inconsistent(tmp_path):
    m = small_manifest()
    uri = str(tmp_path / "e")
    write_store(uri, m)
    bad = json.loads(json.dumps(m))
    bad["shapes"]["top_k"] = 5
    (tmp_path / "e" / "manifest.json").write_text(json.dumps(bad))
    with pytest.raises(StoreError, match="fingerprint does not match"):
        store.open_store(uri)


def test_init_store_refuses_other_config_and_touches_nothing(store_root):
    m = small_manifest()
    uri = store_root + "/cfg"
    write_store(uri, m)
    before = {f["name"]: paths.read_bytes(paths.join(uri, f["name"])) for f in paths.list_files(uri)}
    with pytest.raises(ConfigMismatchError) as e:
        store.init_store(uri, small_manifest(top_k=8, seq_len=32))
    assert "shapes.top_k: store has 4, this run has 8" in str(e.value)
    assert "shapes.seq_len: store has 16, this run has 32" in str(e.value)
    after = {f["name"]: paths.read_bytes(paths.join(uri, f["name"])) for f in paths.list_files(uri)}
    assert before == after


def test_init_store_refuses_non_empty_non_store(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "data.bin").write_bytes(b"1")
    with pytest.raises(StoreError, match="is not empty and holds no manifest.json"):
        store.init_store(str(tmp_path / "x"), small_manifest())


def test_record_from_another_store_is_rejected(tmp_path):
    m = small_manifest()
    other = small_manifest(teacher="another")
    write_store(str(tmp_path / "a"), m)
    write_store(str(tmp_path / "b"), other)
    # Replace a's first chunk by b's chunk renamed to a's tag and a valid checksum.
    name_a = _first_chunk(str(tmp_path / "a"))
    name_b = _first_chunk(str(tmp_path / "b"))
    data = (tmp_path / "b" / name_b).read_bytes()
    import hashlib

    forged = store.chunk_name(m["fingerprint"][:8], 0, 0, 2, hashlib.sha256(data).hexdigest())
    (tmp_path / "a" / name_a).unlink()
    (tmp_path / "a" / forged).write_bytes(data)
    s = store.open_store(str(tmp_path / "a"))
    with pytest.raises(StoreError, match="belongs to another store"):
        s.read(0)


def test_grain_random_access(tmp_path):
    import grain

    m = small_manifest()
    uri = str(tmp_path / "g")
    write_store(uri, m)
    s = store.open_store(uri)
    ds = grain.MapDataset.source(s).map(lambda r: int(r["example_index"]))
    assert list(ds) == list(range(len(s)))


def test_background_writer_applies_back_pressure(tmp_path):
    """A slow commit (upload) blocks submit: steps in memory stay bounded."""
    import time

    from logit_distill.store.synthetic import synthetic_step

    m = small_manifest(num_steps=12, steps_per_file=1)
    uri = str(tmp_path / "bp")
    store.init_store(uri, m)
    committed = []

    def slow_commit(info):
        time.sleep(0.2)
        committed.append(info)

    writer = store.BackgroundWriter(uri, m, 0, max_pending_steps=2, max_pending_chunks=1, on_commit=slow_commit)
    most_in_flight = 0
    for step in range(12):
        writer.submit(step, synthetic_step(m, step, 0))
        most_in_flight = max(most_in_flight, step + 1 - len(committed))
    writer.close()
    # queue (2) + chunk queue (1) + one being encoded + one being committed
    assert most_in_flight <= 2 + 1 + 2
    assert len(committed) == 12 and store.scan(uri, m).complete
