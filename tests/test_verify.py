"""logit_distill.verify: a good store passes; each kind of damage fails, naming the problem and the file."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil

import numpy as np
import pytest

from logit_distill import codec, paths, store
from logit_distill.store.synthetic import synthetic_step
from logit_distill.cli import main as cli_main
from logit_distill.cli.main import build_parser
from logit_distill.verify import verify_store
from logit_distill.verify import VerifyConfig
from store_helpers import small_manifest, write_store


def _chunk_names(uri):
    return sorted(f["name"] for f in paths.list_files(uri) if f["name"].startswith("chunk-"))


def _problems(report, name):
    return report.check(name)["details"].get("problems", [])


@pytest.fixture(scope="module")
def good_store(tmp_path_factory):
    """A complete local store (default codec, 2 processes, 5 steps in 3 chunks per process)."""
    uri = str(tmp_path_factory.mktemp("good") / "store")
    m = small_manifest(num_processes=2)
    write_store(uri, m)
    return uri, m


@pytest.fixture
def copy_of(good_store, tmp_path):
    uri = str(tmp_path / "copy")
    shutil.copytree(good_store[0], uri)
    return uri


# ----------------------------------------------------------------------------- good stores


def test_good_store_passes_with_reports(store_root):
    m = small_manifest(num_processes=2)
    uri = store_root + "/good"
    write_store(uri, m)
    report = verify_store(VerifyConfig(store=uri, expected_steps=5, report_json=uri + "-report.json", report_md=uri + "-report.md",
                          progress=False))
    assert report.passed, report.failure_line()
    status = {c["name"]: c["status"] for c in report.checks}
    assert status == {"manifest": "passed", "coverage": "passed", "integrity": "passed", "records": "passed",
                      "data_alignment": "skipped", "teacher_spot_check": "skipped"}
    f = report.figures
    assert f["examples"] == f["examples_expected"] == 20 and f["chunks"] == 6
    assert f["positions"] == 20 * 16 and 0 < f["tokens"] < f["positions"]  # padding excluded
    assert f["bytes"] == sum(x["size"] for x in paths.list_files(uri) if x["name"].startswith("chunk-"))
    assert f["bytes_per_entry"] == pytest.approx(f["bytes"] / (20 * 16 * 4))
    assert f["bytes_per_position"] == pytest.approx(f["bytes"] / (20 * 16))
    assert 0 < f["mean_topk_mass"] < 1 and f["teacher_entropy_lower_bound_nats"] > 0 and f["elapsed_s"] > 0
    data = json.loads(paths.read_bytes(uri + "-report.json"))
    assert data["passed"] is True and [c["name"] for c in data["checks"]][:2] == ["manifest", "coverage"]
    md = paths.read_bytes(uri + "-report.md").decode()
    assert "# Logit store verification: PASSED" in md and "| integrity | ✅ passed |" in md
    assert report.failure_line().startswith("verify passed:")


def test_exact_codec_and_leftovers_pass(tmp_path):
    uri = str(tmp_path / "s")
    write_store(uri, small_manifest(codec="exact"))
    (tmp_path / "s" / ".tmp-abc-chunk.array_record").write_bytes(b"partial")
    (tmp_path / "s" / "notes.txt").write_text("x")
    report = verify_store(VerifyConfig(store=uri, progress=False))
    assert report.passed, report.failure_line()
    cov = report.check("coverage")
    assert cov["details"]["leftovers"] == [".tmp-abc-chunk.array_record", "notes.txt"]
    assert "2 leftover file(s)" in cov["message"]


# ----------------------------------------------------------------------------- damage


def test_flipped_byte_fails_integrity(store_root):
    uri = store_root + "/flip"
    write_store(uri, small_manifest())
    name = _chunk_names(uri)[1]
    data = bytearray(paths.read_bytes(paths.join(uri, name)))
    data[len(data) // 3] ^= 0x40
    paths.write_bytes_atomic(paths.join(uri, name), bytes(data))
    report = verify_store(VerifyConfig(store=uri, progress=False))
    assert not report.passed
    assert [c["name"] for c in report.failed_checks] == ["integrity"]
    msg = report.check("integrity")["message"]
    assert f"{paths.join(uri, name)}: checksum mismatch" in msg
    assert report.failure_line().startswith(f"verify failed: integrity: {paths.join(uri, name)}")


def test_truncated_chunk_fails_integrity(copy_of):
    name = _chunk_names(copy_of)[2]
    path = os.path.join(copy_of, name)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) * 3 // 4])
    report = verify_store(VerifyConfig(store=copy_of, progress=False))
    assert [c["name"] for c in report.failed_checks] == ["integrity"]
    problems = _problems(report, "integrity")
    assert all(p["chunk"] == name for p in problems)
    assert "checksum mismatch" in problems[0]["message"] and "truncated" in problems[0]["message"]
    assert any("not a readable ArrayRecord file" in p["message"] or "corrupt ArrayRecord" in p["message"]
               for p in problems)


def test_deleted_middle_chunk_names_missing_steps(copy_of):
    middle = [n for n in _chunk_names(copy_of) if "-p00001-s000000002-000000004-" in n][0]
    os.remove(os.path.join(copy_of, middle))
    report = verify_store(VerifyConfig(store=copy_of, progress=False))
    assert [c["name"] for c in report.failed_checks] == ["coverage"]
    msg = report.check("coverage")["message"]
    assert "missing steps [2, 4) of process 1" in msg and copy_of in msg
    assert report.check("coverage")["details"]["missing"] == {"1": [[2, 4]]}
    assert report.figures["examples"] == 20 - 2 * 2


def test_wrong_expected_steps(good_store):
    report = verify_store(VerifyConfig(store=good_store[0], expected_steps=6, progress=False))
    assert [c["name"] for c in report.failed_checks] == ["coverage"]
    assert "the manifest says 5 steps, --expected-steps says 6" in report.check("coverage")["message"]
    assert verify_store(VerifyConfig(store=good_store[0], expected_steps=5, progress=False)).passed


def test_chunk_of_another_configuration_copied_in(copy_of, tmp_path):
    other_uri = str(tmp_path / "other")
    other = small_manifest(num_processes=2, teacher="another")
    write_store(other_uri, other, steps=[0, 1])
    name = _chunk_names(other_uri)[0]
    shutil.copy(os.path.join(other_uri, name), os.path.join(copy_of, name))
    report = verify_store(VerifyConfig(store=copy_of, progress=False))
    assert [c["name"] for c in report.failed_checks] == ["coverage"]
    msg = report.check("coverage")["message"]
    assert f"{name}: foreign chunk" in msg and "another store configuration" in msg


def test_renamed_chunk_of_another_configuration(good_store, copy_of, tmp_path):
    """Copied in under this store's name and a valid checksum: the records' store tag betrays it."""
    _, m = good_store
    other_uri = str(tmp_path / "other")
    write_store(other_uri, small_manifest(num_processes=2, teacher="another"), steps=[0, 1])
    data = open(os.path.join(other_uri, _chunk_names(other_uri)[0]), "rb").read()
    victim = _chunk_names(copy_of)[0]
    os.remove(os.path.join(copy_of, victim))
    forged = store.chunk_name(m["fingerprint"][:8], 0, 0, 2, hashlib.sha256(data).hexdigest())
    open(os.path.join(copy_of, forged), "wb").write(data)
    report = verify_store(VerifyConfig(store=copy_of, progress=False))
    assert [c["name"] for c in report.failed_checks] == ["records"]
    p = _problems(report, "records")[0]
    assert p["kind"] == "store_tag" and p["chunk"] == forged and p["record"] == 0
    assert forged in p["message"] and "belongs to another store" in p["message"]


def test_renamed_chunk_of_other_shapes_is_named(good_store, copy_of, tmp_path):
    _, m = good_store
    other_uri = str(tmp_path / "other")
    write_store(other_uri, small_manifest(num_processes=2, top_k=8, seq_len=8), steps=[0, 1])
    data = open(os.path.join(other_uri, _chunk_names(other_uri)[0]), "rb").read()
    os.remove(os.path.join(copy_of, _chunk_names(copy_of)[0]))
    forged = store.chunk_name(m["fingerprint"][:8], 0, 0, 2, hashlib.sha256(data).hexdigest())
    open(os.path.join(copy_of, forged), "wb").write(data)
    report = verify_store(VerifyConfig(store=copy_of, progress=False))
    problems = _problems(report, "records")
    assert problems and all(p["kind"] == "header" and p["chunk"] == forged for p in problems)
    assert "seq_len 8 (manifest: 16)" in problems[0]["message"]


def test_duplicate_chunk_for_one_range(copy_of, tmp_path, good_store):
    _, m = good_store
    other_uri = str(tmp_path / "seed1")
    write_store(other_uri, m, steps=[0, 1], seed=1)  # same configuration, other content
    name = [n for n in _chunk_names(other_uri) if "-p00000-" in n][0]
    shutil.copy(os.path.join(other_uri, name), os.path.join(copy_of, name))
    report = verify_store(VerifyConfig(store=copy_of, progress=False))
    assert "coverage" in [c["name"] for c in report.failed_checks]
    msg = report.check("coverage")["message"]
    assert "several committed chunks for process 0 steps [0, 2)" in msg and name in msg


def _write_raw_chunk(uri, manifest, process, start, end, records):
    w = store.ChunkWriter(uri, manifest, process, start, end)
    for r in records:
        w.write(r)
    return w.commit()


def test_bad_records_are_named(tmp_path):
    """Each per-record check fires on a crafted record and names chunk, record and example."""
    m = small_manifest(codec="exact", num_steps=2, steps_per_file=2, examples_per_step=8)
    uri = str(tmp_path / "bad")
    store.init_store(uri, m)
    recs = {s: synthetic_step(m, s, 0) for s in range(2)}
    r0 = recs[0]
    r0["topk_logprobs"][1, 3, [0, 1]] = r0["topk_logprobs"][1, 3, [1, 0]]  # unsorted
    r0["topk_logprobs"][2, 5, 0] = 0.5  # > 0
    r0["topk_ids"][3, 7, 1] = r0["topk_ids"][3, 7, 0]  # repeated id
    r0["topk_ids"][4, 2, 2] = 300  # outside the vocabulary (300)
    r0["tail_logprob"][5, 9] = -0.01  # mass > 1
    r0["example_index"][6] = 99  # misplaced
    raw = []
    for s in range(2):
        raw += store.writer.encode_step(m, recs[s], store.manifest.store_tag(m))
    # a NaN log-prob in record 7 (position 0, entry 3): the codec refuses to write one, so set the bytes
    h = codec.decode_header(raw[7])
    off = codec.HEADER.size + h["num_runs"] * codec.RUN_DTYPE.itemsize + 4 * h["seq_len"] \
        + 4 * h["seq_len"] * h["top_k"] + 4 * 3
    raw[7] = raw[7][:off] + np.float32(np.nan).tobytes() + raw[7][off + 4:]
    # a corrupt token in record 8 (step 1): its token hash no longer matches
    bad = bytearray(raw[8])
    off = codec.HEADER.size + codec.decode_header(raw[8])["num_runs"] * codec.RUN_DTYPE.itemsize
    bad[off] ^= 0x01
    raw[8] = bytes(bad)
    info = _write_raw_chunk(uri, m, 0, 0, 2, raw)
    report = verify_store(VerifyConfig(store=uri, progress=False))
    assert [c["name"] for c in report.failed_checks] == ["records"]
    problems = {}  # (kind, record) -> problem; one damage may break several checks (e.g. a log-prob > 0)
    for p in _problems(report, "records"):
        problems.setdefault((p["kind"], p["record"]), p)
    expect = {"logprob_sorted": (1, 3), "logprob_positive": (2, 5), "id_distinct": (3, 7), "id_range": (4, 2),
              "normalization": (5, 9), "example_index": (6, None), "logprob_finite": (7, 0), "token_hash": (8, None)}
    for kind, (record, position) in expect.items():
        assert (kind, record) in problems, (kind, list(problems))
        p = problems[kind, record]
        assert p["chunk"] == info.name and p["example"] == record
        assert f"{info.name} record {record} (example {record})" in p["message"]
        if position is not None:
            assert p["position"] == position and f"at position {position}" in p["message"]
    assert "holds example 99" in problems["example_index", 6]["message"]
    assert {r for _, r in problems} == set(range(1, 9))  # the good record 0 and records 9.. pass


def test_not_a_store_and_bad_manifest(tmp_path, good_store):
    from logit_distill.errors import EXIT_BAD_INPUT, NotAStoreError

    with pytest.raises(NotAStoreError, match="is not a logit store: it does not exist") as e:
        verify_store(VerifyConfig(store=str(tmp_path / "nothing"), progress=False))
    assert e.value.exit_code == EXIT_BAD_INPUT  # the wrong path, not a damaged store
    uri = str(tmp_path / "edited")
    shutil.copytree(good_store[0], uri)
    m = json.loads(open(os.path.join(uri, "manifest.json")).read())
    m["shapes"]["top_k"] = 5
    open(os.path.join(uri, "manifest.json"), "w").write(json.dumps(m))
    report = verify_store(VerifyConfig(store=uri, progress=False))
    assert "fingerprint does not match" in report.check("manifest")["message"]
    m["format_version"] = 7
    open(os.path.join(uri, "manifest.json"), "w").write(json.dumps(m))
    assert "unknown store format version 7" in verify_store(VerifyConfig(store=uri, progress=False)).failure_line()


# ----------------------------------------------------------------------------- CLI


def test_cli_exit_status_reports_and_stderr(copy_of, tmp_path, capsys):
    rj, rm = str(tmp_path / "r.json"), str(tmp_path / "r.md")
    assert cli_main(["verify", "--store", copy_of, "--expected-steps", "5", "--report-json", rj, "--report-md", rm,
                 "--no-progress"]) == 0
    assert json.load(open(rj))["passed"] is True
    capsys.readouterr()
    name = _chunk_names(copy_of)[0]
    os.remove(os.path.join(copy_of, _chunk_names(copy_of)[-1]))
    data = bytearray(open(os.path.join(copy_of, name), "rb").read())
    data[100] ^= 1
    open(os.path.join(copy_of, name), "wb").write(bytes(data))
    assert cli_main(["verify", "--store", copy_of, "--report-json", rj, "--report-md", rm, "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("logit-distill verify: failed: coverage: ") and "(also failed: integrity)" in err[-1]
    assert any(line.startswith("logit-distill verify: failed: integrity: ") and name in line for line in err[:-1])
    report = json.load(open(rj))
    assert report["passed"] is False
    assert "# Logit store verification: FAILED" in open(rm).read() and name in open(rm).read()
    assert cli_main(["verify", "--store", copy_of, "--spot-check", "3", "--no-progress"]) == 2  # needs --teacher


def test_cli_documents_every_flag():
    (sub,) = [a for a in build_parser()._actions if a.dest == "command"]
    p = sub.choices["verify"]
    for action in p._actions:
        assert action.help, action.option_strings


# ----------------------------------------------------------------------------- data and teacher


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    """A real dump of preset:tiny-qwen3 over a small JSONL data set, and a copy whose top-k are
    shifted by one position against the tokens."""
    from logit_distill.data import ExampleSource
    from logit_distill.models import load_model
    from logit_distill.selection import make_teacher_topk

    root = tmp_path_factory.mktemp("dump")
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge".split()
    data = str(root / "data.jsonl")
    with open(data, "w") as f:
        for _ in range(40):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(3, 30)))}) + "\n")
    teacher = load_model("preset:tiny-qwen3")
    source = ExampleSource.open(data, teacher.tokenizer_path, seq_len=32, packing=True, seed=3)
    m = store.build_manifest(
        seq_len=32, top_k=8, vocab_size=teacher.vocab_size, codec="default", num_steps=4, examples_per_step=4,
        steps_per_file=2, content={"teacher": teacher.identity, "teacher_dtype": "float32", "data": source.identity},
    )
    fn = make_teacher_topk(teacher.apply, 8)
    good, shifted = str(root / "good"), str(root / "shifted")
    for uri in (good, shifted):
        store.init_store(uri, m)
    w_good, w_shift = store.BackgroundWriter(good, m, 0), store.BackgroundWriter(shifted, m, 0)
    for step in range(4):
        batch = source.batch(range(step * 4, step * 4 + 4))
        out = {k: np.asarray(v) for k, v in fn(teacher.params, batch["tokens"], batch["positions"],
                                               batch["segment_ids"], np.zeros(4, np.int32)).items()}
        recs = dict(batch, **out, example_index=np.arange(step * 4, step * 4 + 4))
        w_good.submit(step, recs)
        rolled = dict(recs, **{k: np.roll(out[k], -1, axis=1) for k in out})  # position l gets l+1's top-k
        w_shift.submit(step, rolled)
    w_good.close()
    w_shift.close()
    return {"good": good, "shifted": shifted, "data": data, "root": root}


def test_real_dump_passes_data_and_teacher_checks(dumped):
    report = verify_store(VerifyConfig(store=dumped["good"], expected_steps=4, data=dumped["data"], teacher="preset:tiny-qwen3",
                          spot_check=4, sample=16, progress=False))
    assert report.passed, report.failure_line()
    data = report.check("data_alignment")
    assert data["status"] == "passed" and data["details"]["examples_compared"] == 16
    spot = report.check("teacher_spot_check")
    assert spot["status"] == "passed" and spot["details"]["examples_compared"] == 4
    assert spot["details"]["max_abs_error"] <= codec.LOGPROB_MAX_ERROR + 1e-4


def test_shifted_logits_fail_the_teacher_spot_check(dumped):
    report = verify_store(VerifyConfig(store=dumped["shifted"], teacher="preset:tiny-qwen3", spot_check=3, progress=False))
    # Every record is well-formed: only recomputing the teacher shows the misalignment.
    assert [c["name"] for c in report.failed_checks] == ["teacher_spot_check"]
    p = _problems(report, "teacher_spot_check")[0]
    assert p["chunk"] in _chunk_names(dumped["shifted"])
    assert f"{p['chunk']} record {p['record']} (example {p['example']})" in p["message"]
    assert "differ from the recomputed teacher" in p["message"]


def test_other_data_fails_alignment(dumped):
    other = str(dumped["root"] / "other.jsonl")
    with open(other, "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": f"completely different text number {i} " * 3}) + "\n")
    report = verify_store(VerifyConfig(store=dumped["good"], data=other, tokenizer=None, teacher="preset:tiny-qwen3", sample=4,
                          progress=False))
    assert [c["name"] for c in report.failed_checks] == ["data_alignment"]
    problems = _problems(report, "data_alignment")
    assert any(p["kind"] == "identity" and p["field"] == "data_sha256" for p in problems)
    assert any(p["kind"] == "tokens" and p["chunk"] in p["message"] for p in problems)
