"""Training figures: train_overhead_ratio, online_over_offline_step_ratio, loader_over_train_throughput,
verify_over_decode_ratio and kd_vs_ce_heldout."""

from __future__ import annotations

import os
import time

import numpy as np

from . import common
from .common import BENCH_STUDENT, BENCH_TEACHER, log
from logit_distill.verify import VerifyConfig
from logit_distill.train import TrainConfig


def _synthetic_store(name: str, *, seq_len: int, batch: int, steps: int, steps_per_file: int,
                     vocab_size: int = 32000, top_k: int = 64) -> str:
    """A complete default-codec store of well-formed records (``common.fake_step``)."""
    from logit_distill import store as store_mod

    manifest = store_mod.build_manifest(seq_len=seq_len, top_k=top_k, vocab_size=vocab_size, codec="default",
                                        num_steps=steps, examples_per_step=batch, steps_per_file=steps_per_file,
                                        content={"bench": name})
    uri = common.fresh_dir(name)
    store_mod.init_store(uri, manifest)
    store_mod.write_examples(uri, manifest, 0, {s: common.fake_step(manifest, s) for s in range(steps)})
    return uri


# ----------------------------------------------------------------------------- verify


def verify(size: dict) -> dict:
    """verify_store (every check that needs only the store) vs one plain single-threaded pass that
    reads every chunk (checksum checked on open, as the reader does) and decodes every record."""
    from logit_distill import codec as codec_mod
    from logit_distill.store import open_store
    from logit_distill.verify import verify_store

    L, B, N = size["verify_seq_len"], size["verify_batch"], size["verify_steps"]
    uri = _synthetic_store("verify-store", seq_len=L, batch=B, steps=N, steps_per_file=16)
    reports = []

    def run_verify():
        reports.append(verify_store(VerifyConfig(store=uri, progress=False)))

    def decode_pass():
        n = 0
        with open_store(uri) as st:
            for chunk in sorted(st.scan.chunks.values(), key=lambda c: c.key):
                for raw in st.read_chunk(chunk):
                    codec_mod.decode_record(raw)
                    n += 1
        assert n == N * B

    def read_pass():  # Store.read(i) per example: random access, one record at a time
        with open_store(uri) as st:
            for i in range(len(st)):
                st.read(i)

    fns = {"verify": run_verify, "decode_pass": decode_pass, "read_each_pass": read_pass}
    for fn in fns.values():
        fn()
    times = common.interleave(fns, size["verify_repeats"])
    assert all(r.passed for r in reports), reports[-1].failure_line()
    return {
        "verify_over_decode_ratio": {
            "value": common.ratio(times, "verify", "decode_pass"),
            "details": {
                "store": f"{N * B} synthetic records, seq_len {L}, top_k 64, vocab 32000, default codec, "
                         f"{-(-N // 16)} chunks, {common.dir_bytes(uri) / 1e6:.1f} MB",
                "verify": common.summary(times["verify"]),
                "decode_pass": common.summary(times["decode_pass"]),
                "read_each_pass": common.summary(times["read_each_pass"]),
                "verify_over_read_each_ratio": common.ratio(times, "verify", "read_each_pass"),
                "verify_workers": 2,
            },
        }
    }


# ----------------------------------------------------------------------------- train steps


def train(size: dict) -> dict:
    """One student, one batch shape: the offline KD step, a CE-only step, the online KD step (teacher
    forward + top-k on the batch, then the same step) and the Grain loader over a store, interleaved."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from logit_distill.store import open_store
    from logit_distill.selection import make_teacher_topk
    from logit_distill.train import loader as loader_mod
    from logit_distill.models.sharding import make_mesh
    from logit_distill.train.step import make_optimizer, make_train_step
    from logit_distill.train.losses import distill_loss

    L, B, k = size["train_seq_len"], size["train_batch"], 64
    reps, loader_batches = size["train_repeats"], size["loader_batches"]
    steps = 32  # 128 examples at batch 4; the loader repeats epochs as train_student does
    uri = _synthetic_store("train-store", seq_len=L, batch=B, steps=steps, steps_per_file=8)
    store = open_store(uri)
    loader_mod.verify_store_for_training(store, loss="topk_kl")

    mesh = make_mesh(jax.devices())
    sharding = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())

    def put(batch: dict) -> dict:
        return {key: jax.make_array_from_process_local_data(sharding, np.ascontiguousarray(v))
                for key, v in batch.items()}

    student = common.build(BENCH_STUDENT, 1)
    teacher = common.build(BENCH_TEACHER, 0)
    tx = make_optimizer(optax.constant_schedule(1e-3), weight_decay=0.0, max_grad_norm=1.0, grad_accum=1)

    def new_state():
        params = jax.tree.map(lambda x: jax.device_put(jnp.array(x), replicated), student.params)
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    kd_step = jax.jit(make_train_step(student.apply, tx, loss="topk_kl", temperature=1.0), donate_argnums=(0,))

    def ce_only_train_step(state, batch):  # the same step with the plain CE loss: no teacher fields at all
        def loss_fn(params):
            logits = student.apply(params, batch["tokens"], batch["positions"], batch["segment_ids"])
            return distill_loss(logits, batch, alpha=0.0)

        (value, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return ({"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
                 "step": state["step"] + 1}, {"loss": value, "grad_norm": optax.tree.norm(grads)})

    ce_step = jax.jit(ce_only_train_step, donate_argnums=(0,))
    teacher_fn = make_teacher_topk(teacher.apply, k)  # as train_student's online mode
    example_index = jnp.zeros((B,), jnp.int32)
    teacher_params = jax.device_put(teacher.params, replicated)

    # One batch from the store, through the real loader (same fields train_student puts on device).
    ds = loader_mod.build_dataset(store, seed=0, batch_size=B, num_batches=1)
    host = next(iter(ds))
    kd_fields = loader_mod.MODEL_FIELDS + ("topk_ids", "topk_logprobs")
    kd_host = {f: host[f] for f in kd_fields}
    model_host = {f: host[f] for f in loader_mod.MODEL_FIELDS}
    alpha = jnp.asarray(0.5, jnp.float32)
    alpha0 = jnp.asarray(0.0, jnp.float32)
    states = {name: new_state() for name in ("kd", "ce", "ce_alpha0", "online")}

    def run_kd():
        states["kd"], m = kd_step(states["kd"], put(kd_host), alpha)
        jax.block_until_ready(m["loss"])

    def run_ce():
        states["ce"], m = ce_step(states["ce"], put(model_host))
        jax.block_until_ready(m["loss"])

    def run_ce_alpha0():  # train_student's CE-only run: alpha 0 through the KD step (KD kept as a metric)
        states["ce_alpha0"], m = kd_step(states["ce_alpha0"], put(kd_host), alpha0)
        jax.block_until_ready(m["loss"])

    def run_online():
        batch = put(model_host)
        out = teacher_fn(teacher_params, batch["tokens"], batch["positions"], batch["segment_ids"], example_index)
        batch.update({key: v for key, v in out.items() if key in kd_fields})
        states["online"], m = kd_step(states["online"], batch, alpha)
        jax.block_until_ready(m["loss"])

    loader_seed = iter(range(1, 10**6))

    def run_loader():
        ds = loader_mod.build_dataset(store, seed=next(loader_seed), batch_size=B, num_batches=loader_batches + 1)
        it = loader_mod.make_iterator(ds)
        next(it)  # the pipeline's start (threads, first reads) is not throughput
        t0 = time.perf_counter()
        for _ in range(loader_batches):
            next(it)
        loader_times.append(time.perf_counter() - t0)

    loader_times: list[float] = []
    fns = {"offline_kd": run_kd, "ce_only": run_ce, "ce_alpha0": run_ce_alpha0, "online_kd": run_online,
           "loader": run_loader}
    log("train: compiling the steps")
    for fn in fns.values():
        fn()
        fn()
    loader_times.clear()
    log(f"train: {reps} interleaved rounds, batch {B} x {L} tokens")
    times = common.interleave(fns, reps)
    store.close()

    kd_s = common.median(times["offline_kd"])
    loader_eps = loader_batches * B / common.median(loader_times)
    train_eps = B / kd_s
    # per round: (examples / loader pass time) / (examples / KD step time)
    loader_ratio = common.paired_ratio([loader_batches * B / t for t in loader_times],
                                       [B / t for t in times["offline_kd"]])
    flops_t = common.forward_flops_per_token(BENCH_TEACHER, L)
    flops_s = common.forward_flops_per_token(BENCH_STUDENT, L)
    tokens = B * L
    shapes = {"batch": B, "seq_len": L, "top_k": k, "vocab_size": 32000,
              "student": "Qwen3-style, 4 layers, width 128, vocab 32000",
              "teacher": "bench teacher: Qwen3-style, 8 layers, width 512, vocab 32000"}
    return {
        "train_overhead_ratio": {
            "value": common.ratio(times, "offline_kd", "ce_only"),
            "details": {
                **shapes,
                "offline_kd_step": common.summary(times["offline_kd"]),
                "ce_only_step": common.summary(times["ce_only"]),
                "ce_alpha0_step": common.summary(times["ce_alpha0"]),
                "alpha0_over_ce_only_ratio": common.ratio(times, "ce_alpha0", "ce_only"),
                "offline_kd_tokens_per_s": tokens / kd_s,
                "what": "loss topk_kl, alpha 0.5 (train_student's step, host batch put on device each step) vs "
                        "the same step with plain CE and no teacher fields; ce_alpha0 = train_student's CE-only "
                        "run (alpha 0 through the KD step, which still evaluates the KD loss as a metric)",
            },
        },
        "online_over_offline_step_ratio": {
            "value": common.ratio(times, "online_kd", "offline_kd"),
            "details": {
                **shapes,
                "online_kd_step": common.summary(times["online_kd"]),
                "offline_kd_step": common.summary(times["offline_kd"]),
                "teacher_over_student_forward_flops": flops_t / flops_s,
                "teacher_forward_flops_per_token": flops_t,
                "student_forward_flops_per_token": flops_s,
                "online_kd_tokens_per_s": tokens / common.median(times["online_kd"]),
            },
        },
        "loader_over_train_throughput": {
            "value": loader_ratio,
            "details": {
                **shapes,
                "loader_examples_per_s": loader_eps,
                "train_examples_per_s": train_eps,
                "loader_pass": common.summary(loader_times),
                "loader_batches_per_pass": loader_batches,
                "loader": "loader.build_dataset + make_iterator (Grain, 4 threads, prefetch 8) over a "
                          "default-codec store of synthetic records",
            },
        },
    }


# ----------------------------------------------------------------------------- KD vs CE


def kd_vs_ce(size: dict) -> dict:
    """Data sampled from preset:demo-teacher; its store dumped; tiny-qwen3 trained with KD and with CE
    only (same steps, batches, seed); held-out cross-entropy of both and of the teacher."""
    from logit_distill.data import write_pretokenized
    from logit_distill.dump import DumpConfig, run_dump
    from logit_distill.models import load_model
    from logit_distill.sampling import sample_documents
    from logit_distill.train import train_student
    from logit_distill.train.evaluate import evaluate, open_eval_data

    root = common.fresh_dir("kd")
    teacher_spec, student_spec = "preset:demo-teacher", "preset:tiny-qwen3"
    n_train, n_eval, doc_len = size["kd_docs"], size["kd_eval_docs"], size["kd_doc_len"]
    L, B, steps, k = size["kd_seq_len"], size["kd_batch"], size["kd_steps"], size["kd_top_k"]
    teacher = load_model(teacher_spec)
    eos = int(teacher.hf_config["eos_token_id"])
    tokenizer = teacher.tokenizer_path  # the presets' tokenizer covers all 512 ids
    # the documents are a pure function of the teacher, their number, length and seed: sampled once, kept
    cache = os.path.join(common.OUT, "kd-cache",
                         f"docs-{teacher_spec.split(':')[-1]}-{n_train + n_eval}x{doc_len}-seed0.npz")
    t0 = time.perf_counter()
    if os.path.exists(cache):
        with np.load(cache) as f:
            docs = list(f["docs"])
    else:
        log(f"kd: sampling {n_train + n_eval} documents of {doc_len} tokens from {teacher_spec}")
        docs = sample_documents(teacher, num_docs=n_train + n_eval, doc_len=doc_len, seed=0, bos_id=eos)
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        np.savez(cache + ".tmp.npz", docs=np.stack(docs))
        os.replace(cache + ".tmp.npz", cache)
    sample_s = time.perf_counter() - t0
    train_data = write_pretokenized(os.path.join(root, "train.array_record"), docs[:n_train])
    eval_data = write_pretokenized(os.path.join(root, "eval.array_record"), docs[n_train:])
    store = os.path.join(root, "store")
    t0 = time.perf_counter()
    dumped = run_dump(DumpConfig(teacher=teacher_spec, data=train_data, output=store, selection="topk", top_k=k,
                                 seq_len=L, batch_size=B, steps_per_file=10, tokenizer=tokenizer, progress=False))
    dump_s = time.perf_counter() - t0
    # The demo's recipe: the k+1-bin loss, pure KD against pure CE.
    common_args = dict(store=store, student=student_spec, num_steps=steps, batch_size=B, learning_rate=3e-3,
                       loss="topk_tail_kl", checkpoint_every=steps, progress=False, seed=0)
    log(f"kd: training {student_spec} {steps} steps with KD and with CE only")
    t0 = time.perf_counter()
    kd = train_student(TrainConfig(output=os.path.join(root, "kd"), alpha=1.0, **common_args))
    ce = train_student(TrainConfig(output=os.path.join(root, "ce"), alpha=0.0, **common_args))
    train_s = time.perf_counter() - t0
    examples = open_eval_data(eval_data, tokenizer, seq_len=L, packing=True, vocab_size=teacher.vocab_size)

    def heldout(model) -> dict:
        return evaluate(model.apply, model.params, examples, batch_size=B)

    kd_eval, ce_eval = heldout(load_model(kd.hf_dir)), heldout(load_model(ce.hf_dir))
    value = {
        "kd_student": kd_eval["cross_entropy"],
        "ce_student": ce_eval["cross_entropy"],
        "teacher": heldout(teacher)["cross_entropy"],
    }
    return {
        "kd_vs_ce_heldout": {
            "value": value,
            "details": {
                "untrained_student": heldout(load_model(student_spec))["cross_entropy"],
                "uniform_over_vocab": float(np.log(teacher.vocab_size)),
                "train_tokens": int(sum(len(d) for d in docs[:n_train])),
                "unit": "nats per token on held-out documents sampled from the teacher",
                "teacher": teacher_spec, "student": student_spec,
                "train_documents": n_train, "eval_documents": n_eval, "doc_len": doc_len,
                "seq_len": L, "batch_size": B, "steps": steps, "learning_rate": 3e-3,
                "kd": f"loss topk_tail_kl, alpha 1, top_k {k} of {teacher.vocab_size} (default codec store)",
                "ce": "alpha 0 (same loop, same batches)",
                "eval_tokens": kd_eval["num_tokens"],
                "store_examples": dumped.examples,
                "seconds": {"sampling": sample_s, "dump": dump_s, "training_both": train_s},
            },
        }
    }
