"""The fidelity-per-byte figure: how close each store (and loss) brings a student to the teacher's
whole distribution, against the bytes it stores per position."""

from __future__ import annotations

import os
import time

import numpy as np

from . import common
from .common import log

# Teacher: vocabulary 8192, a small Qwen3-style network whose LM head is scaled so that its
# next-token distributions are neither flat nor one-hot (top-8 mass well below 1: reported).
FIDELITY_TEACHER = {**common.qwen3_config(vocab_size=8192, hidden=64, intermediate=192, layers=2, heads=4,
                                          kv_heads=2, head_dim=16, max_len=256), "tie_word_embeddings": False}
FIDELITY_HEAD_SCALE = 25.0
FIDELITY_STUDENT = {**common.qwen3_config(vocab_size=8192, hidden=64, intermediate=192, layers=2, heads=4,
                                          kv_heads=2, head_dim=16, max_len=256), "tie_word_embeddings": False}

# row -> (store, loss); store None: CE only (alpha 0) or online (the teacher in the loop, k = V).
ROWS = {
    "ce_only": (None, None),
    "full_kd_online": ("online", "topk_kl"),
    "topk_kl_k64": ("topk64", "topk_kl"),
    "topk_tail_kl_k8": ("topk8", "topk_tail_kl"),
    "topk_tail_kl_k64": ("topk64", "topk_tail_kl"),
    "sampled_kl_n16": ("sampled16", "sampled_kl"),
    "sampled_kl_n32": ("sampled32", "sampled_kl"),
    "sampled_kl_n64": ("sampled64", "sampled_kl"),
}
STORES = {"topk64": ("topk", 64), "topk8": ("topk", 8), "sampled16": ("sampled", 16),
          "sampled32": ("sampled", 32), "sampled64": ("sampled", 64)}


def _teacher_dir(root: str) -> str:
    from logit_distill.models import build_model, init_params, save_hf_checkpoint

    out = os.path.join(root, "teacher")
    params = init_params(FIDELITY_TEACHER, 0, "float32")
    params["lm_head"]["weight"] = params["lm_head"]["weight"] * FIDELITY_HEAD_SCALE
    model = build_model(FIDELITY_TEACHER, params, identity={"kind": "fidelity-teacher"})
    save_hf_checkpoint(model, model.params, out)
    return out


def _store_bytes(uri: str) -> tuple[float, float]:
    """(record bytes, file bytes) per position of a store."""
    from logit_distill import paths
    from logit_distill.store import open_store

    with open_store(uri) as st:
        record_bytes = 0
        for chunk in st.scan.chunks.values():
            record_bytes += sum(len(r) for r in st.read_chunk(chunk))
        positions = len(st) * st.manifest["shapes"]["seq_len"]
        files = sum(f["size"] for f in paths.list_files(uri) if f["name"].startswith("chunk-"))
    return record_bytes / positions, files / positions


def _heldout(teacher, student, examples, batch: int) -> dict:
    """Held-out next-token cross-entropy of the student and full-vocabulary KL(teacher || student),
    means over the positions of ``next_token_mask``."""
    import jax
    import jax.numpy as jnp

    from logit_distill.train.losses import next_token_mask, next_token_targets

    @jax.jit
    def sums(tp, sp, tokens, positions, segment_ids):
        t = jax.nn.log_softmax(teacher.apply(tp, tokens, positions, segment_ids).astype(jnp.float32), -1)
        s = jax.nn.log_softmax(student.apply(sp, tokens, positions, segment_ids).astype(jnp.float32), -1)
        mask = next_token_mask(segment_ids)
        kl = jnp.sum(jnp.exp(t) * (t - s), -1)
        ce = -jnp.take_along_axis(s, next_token_targets(tokens)[..., None], -1)[..., 0]
        return jnp.sum(jnp.where(mask, kl, 0.0)), jnp.sum(jnp.where(mask, ce, 0.0)), jnp.sum(mask)

    kl = ce = n = 0.0
    for start in range(0, len(examples) - batch + 1, batch):
        recs = [examples[i] for i in range(start, start + batch)]
        arrs = [np.stack([r[k] for r in recs]) for k in ("tokens", "positions", "segment_ids")]
        a, b, c = sums(teacher.params, student.params, *arrs)
        kl, ce, n = kl + float(a), ce + float(b), n + float(c)
    return {"kl": kl / n, "cross_entropy": ce / n, "positions": int(n)}


def _row_runner(teacher, stores: dict, B: int, steps: int, lr: float):
    """``run(name, store, loss, seed) -> trained student``: train_student's step, optimizer and Grain
    loader (``make_train_step``, ``make_optimizer``, ``loader.build_dataset``), without its checkpoints,
    export and logging, so that each step function compiles once for all seeds."""
    import jax
    import jax.numpy as jnp

    from logit_distill.store import open_store
    from logit_distill.train import loader as loader_mod
    from logit_distill.train.step import make_optimizer, make_train_step
    from logit_distill.train.losses import FIELDS
    from logit_distill.train.schedules import learning_rate_schedule

    tx = make_optimizer(learning_rate_schedule(lr, steps // 10, steps, 0.1), weight_decay=0.0, max_grad_norm=1.0,
                        grad_accum=1)
    opened = {name: open_store(uri) for name, uri in stores.items()}
    student0 = common.build(FIDELITY_STUDENT, 100)
    steps_fns: dict = {}
    V = teacher.vocab_size

    @jax.jit
    def full_teacher(params, tokens, positions, segment_ids):  # online, k = V: every id, no sort needed
        lp = jax.nn.log_softmax(teacher.apply(params, tokens, positions, segment_ids).astype(jnp.float32), -1)
        ids = jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32), lp.shape)
        return {"topk_ids": ids, "topk_logprobs": lp}

    def run(name: str, store, loss, seed: int):
        kind = loss or "topk_kl"
        if kind not in steps_fns:
            steps_fns[kind] = jax.jit(make_train_step(student0.apply, tx, loss=kind, temperature=1.0),
                                      donate_argnums=(0,))
        step = steps_fns[kind]
        st = opened["topk64" if store in (None, "online") else store]
        width = st.manifest["shapes"]["num_samples"] if kind == "sampled_kl" else None
        ds = loader_mod.build_dataset(st, seed=seed, batch_size=B, num_batches=steps, sample_width=width)
        fields = loader_mod.MODEL_FIELDS + FIELDS[kind]
        params = common.build(FIDELITY_STUDENT, 100 + seed).params
        state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
        alpha = jnp.float32(0.0 if loss is None else 1.0)
        for host in loader_mod.make_iterator(ds):
            batch = {k: jnp.asarray(host[k]) for k in fields if k in host}
            if store == "online":
                batch.update(full_teacher(teacher.params, batch["tokens"], batch["positions"], batch["segment_ids"]))
            state, _ = step(state, batch, alpha)
        student = common.build(FIDELITY_STUDENT, 100 + seed)
        student.params = state["params"]
        return student

    return run


def fidelity(size: dict) -> dict:
    from logit_distill.data import write_pretokenized
    from logit_distill.dump import DumpConfig, run_dump
    from logit_distill.models import load_model
    from logit_distill.sampling import sample_documents
    from logit_distill.train.evaluate import open_eval_data

    t_start = time.perf_counter()
    root = common.fresh_dir("fidelity")
    L, B, steps = size["fid_seq_len"], size["fid_batch"], size["fid_steps"]
    n_train, n_eval, seeds, lr = size["fid_docs"], size["fid_eval_docs"], size["fid_seeds"], size["fid_lr"]
    teacher_dir = _teacher_dir(root)
    teacher = load_model(teacher_dir)
    V = teacher.vocab_size
    log(f"fidelity: sampling {n_train + n_eval} documents of {L} tokens from the teacher (vocab {V})")
    docs = sample_documents(teacher, num_docs=n_train + n_eval, doc_len=L, seed=0, bos_id=0)
    train_data = write_pretokenized(os.path.join(root, "train.array_record"), docs[:n_train])
    eval_data = write_pretokenized(os.path.join(root, "eval.array_record"), docs[n_train:])
    examples = open_eval_data(eval_data, None, seq_len=L, packing=True, vocab_size=V)

    stores, store_info = {}, {}
    for name, (selection, n) in STORES.items():
        uri = os.path.join(root, name)
        kw = dict(top_k=n) if selection == "topk" else dict(selection="sampled", samples=n)
        r = run_dump(DumpConfig(teacher=teacher_dir, data=train_data, output=uri, seq_len=L, batch_size=B,
                                steps_per_file=10_000, progress=False, **kw))
        stores[name] = uri
        rec_bpp, file_bpp = _store_bytes(uri)
        store_info[name] = {"bytes_per_position": rec_bpp, "file_bytes_per_position": file_bpp,
                            "examples": r.examples}
        log(f"fidelity: store {name}: {rec_bpp:.1f} bytes/position")

    # Teacher statistics on the held-out positions.
    import jax
    import jax.numpy as jnp

    from logit_distill.train.losses import next_token_mask

    ent, top8, top64, npos = 0.0, 0.0, 0.0, 0
    for start in range(0, len(examples) - B + 1, B):
        recs = [examples[i] for i in range(start, start + B)]
        tok, pos, seg = (np.stack([r[k] for r in recs]) for k in ("tokens", "positions", "segment_ids"))
        lp = np.asarray(jax.nn.log_softmax(teacher.apply(teacher.params, tok, pos, seg), -1), np.float64)
        mask = np.asarray(next_token_mask(jnp.asarray(seg)))
        p = np.exp(lp)[mask]
        srt = np.sort(p, -1)
        ent += float(-(p * lp[mask]).sum()); top8 += float(srt[:, -8:].sum()); top64 += float(srt[:, -64:].sum())
        npos += int(mask.sum())

    rows: dict = {name: {"kl": [], "cross_entropy": []} for name in ROWS}
    train_s: dict = {}
    run_row = _row_runner(teacher, stores, B, steps, lr)
    for s in range(seeds):
        for name, (store, loss) in ROWS.items():
            t0 = time.perf_counter()
            student = run_row(name, store, loss, s)
            m = _heldout(teacher, student, examples, B)
            rows[name]["kl"].append(m["kl"])
            rows[name]["cross_entropy"].append(m["cross_entropy"])
            train_s[name] = train_s.get(name, 0.0) + time.perf_counter() - t0
            log(f"fidelity: seed {s} {name}: held-out KL {m['kl']:.4f}, CE {m['cross_entropy']:.4f} "
                f"({time.perf_counter() - t0:.0f} s)")

    ce_kl = float(np.mean(rows["ce_only"]["kl"]))
    full_kl = float(np.mean(rows["full_kd_online"]["kl"]))
    table = {}
    for name, (store, loss) in ROWS.items():
        kl, ce = np.array(rows[name]["kl"]), np.array(rows[name]["cross_entropy"])
        info = store_info.get(store, {}) if store not in (None, "online") else {}
        table[name] = {
            "loss": loss or "ce (alpha 0)",
            "bytes_per_position": info.get("bytes_per_position"),
            "heldout_cross_entropy": float(ce.mean()),
            "heldout_cross_entropy_sd": float(ce.std(ddof=1)) if len(ce) > 1 else 0.0,
            "heldout_kl": float(kl.mean()),
            "heldout_kl_sd": float(kl.std(ddof=1)) if len(kl) > 1 else 0.0,
            "heldout_kl_per_seed": [float(x) for x in kl],
            "gap_closed": (ce_kl - float(kl.mean())) / (ce_kl - full_kl) if ce_kl != full_kl else float("nan"),
        }
    n32, t64 = table["sampled_kl_n32"], table["topk_tail_kl_k64"]
    offline = {k: v for k, v in table.items() if k not in ("ce_only", "full_kd_online")}
    best = max(offline, key=lambda k: offline[k]["gap_closed"])
    checks = {
        "sampled32_over_topk_tail64_bytes": n32["bytes_per_position"] / t64["bytes_per_position"],
        "sampled32_kl_minus_topk_tail64_kl": n32["heldout_kl"] - t64["heldout_kl"],
        "spread_sd_of_the_two": max(n32["heldout_kl_sd"], t64["heldout_kl_sd"]),
        "every_kd_row_beats_ce_only": all(v["heldout_kl"] < table["ce_only"]["heldout_kl"]
                                          for k, v in table.items() if k != "ce_only"),
        "best_offline_row": best,
        "best_offline_gap_closed": offline[best]["gap_closed"],
    }
    return {
        "fidelity": {
            "value": table,
            "details": {
                "checks": checks,
                "teacher": f"Qwen3-style, 2 layers, width 64, vocab {V}, LM head x{FIDELITY_HEAD_SCALE:g}",
                "student": "the same architecture, its own random init per seed",
                "training": "train_student's step, AdamW and Grain loader (bench/fidelity_bench.py); online full "
                            "KD: topk_kl over all V ids of the teacher run on each batch",
                "teacher_heldout_entropy_nats": ent / npos,
                "teacher_heldout_top8_mass": top8 / npos,
                "teacher_heldout_top64_mass": top64 / npos,
                "heldout_positions": npos,
                "train_documents": n_train, "eval_documents": n_eval, "seq_len": L, "batch_size": B,
                "steps": steps, "learning_rate": lr, "seeds": seeds, "alpha": 1.0, "temperature": 1.0,
                "stores": store_info,
                "bytes": "encoded record bytes / positions (default codec); file_bytes_per_position adds "
                         "ArrayRecord's block padding of these small one-chunk stores",
                "spread": "sd over seeds (student init and shuffle); the stores' draws are fixed (dump seed 0)",
                "seconds": {"total": time.perf_counter() - t_start, **{k: round(v, 1) for k, v in train_s.items()}},
            },
        }
    }
