"""The fidelity-per-byte figure at convergence: how close each store (and loss) brings a student to the
teacher's whole distribution, against the bytes it stores per position.

The set-up (docs/BENCHMARKS.md reports it; the figures come from ``python -m bench.run --only fidelity``):

- Teacher: a Qwen3-style network (2 layers, width 64) whose LM head is scaled so that its next-token
  distributions have about 3 nats of entropy: vocabulary 1024, head x21 (top-64 mass 0.94), the default
  group (the rows of ``fid_rows``); ``--full``: vocabulary 4096, head x25 (top-64 mass 0.92), every row.
- Data: documents sampled from the teacher (so it is the best model of them): training, validation
  (the stopping rule) and test (the figures) documents.
- Stores: simulated, not dumped: the teacher's logits over the training documents go through the
  selection functions (``select_topk``, ``select_sampled``, ``select_systematic``, ``select_hybrid``) with
  the dump's keys, then through the store's default codec (``logit_distill.codec``: the top-k, sampled and
  hybrid records; 'compact' is a hybrid record without a head); students train on what the decoder gives back, and the bytes per position are the encoded
  records' (header, runs and tokens included). Sampled stores draw with the seed of the row's seed.
- Students: the same family, smaller (``fid_student_layers``, ``fid_student_width``: one layer by default),
  their own initialisation per seed; the seeds of a row train together
  (``jax.vmap`` over the seeds), each on its own shuffle. Adam (b1 0.9, b2 0.95), clipping at 1,
  alpha 1 (CE only: 0), T 1, ``losses.distill_loss`` as training uses it. The full-KD row reads the
  teacher's logits over the training documents, computed once. The training set and the stores' fields
  live on the device; the steps between two evaluations run as one call (``lax.scan``), each gathering
  its batch by index there, compiled once per loss.
- Stopping rule (per seed): the validation KL(teacher || student) over the full vocabulary is measured
  every ``fid_eval_every`` steps; a plateau is ``fid_patience`` evaluations without a relative improvement of
  ``fid_tolerance`` on the best so far. At a plateau the learning rate is multiplied by ``fid_decay``; the
  seed has converged at the plateau after ``fid_decays`` such cuts. The row's figures are its test metrics
  at each seed's best validation step.
- Rows are compared paired by seed: the mean over seeds of (row - reference) and its standard error.

Each row's result is saved under bench/out/fidelity/rows/ with the settings it was run with; a rerun with
the same settings reuses it (a killed run resumes at the next row).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time

import numpy as np

from . import common
from .common import log



def model_config(vocab_size: int, layers: int = 2, hidden: int = 64) -> dict:
    """The teacher's architecture (Qwen3-style, 2 layers, width 64, untied head) or a student's."""
    return {**common.qwen3_config(vocab_size=vocab_size, hidden=hidden, intermediate=3 * hidden, layers=layers,
                                  heads=4, kv_heads=2, head_dim=hidden // 4, max_len=256),
            "tie_word_embeddings": False}


def student_config(size: dict) -> dict:
    return model_config(size["fid_vocab"], size["fid_student_layers"], size["fid_student_width"])


# At vocabulary 4096 an LM head x25 gives about 3.0 nats of entropy and 0.92 of the mass on the top 64.
DEFAULT_TEACHER = (4096, 25.0)
TAIL_SHAPE_K = 64  # the teacher's top-k outside which the tail-shape KL compares the spreads

# store -> (selection, settings, layouts whose bytes are reported; the first is what students train on)
STORES = {
    "topk64": ("topk", {"k": 64}, ("topk",)),
    "topk8": ("topk", {"k": 8}, ("topk",)),
    "sampled32": ("sampled", {"n": 32}, ("sampled",)),
    "sampled64": ("sampled", {"n": 64}, ("sampled",)),
    "systematic32": ("systematic", {"n": 32}, ("sampled", "compact")),
    "systematic64": ("systematic", {"n": 64}, ("sampled", "compact")),
    "hybrid4x16": ("hybrid", {"k": 4, "n": 16}, ("hybrid",)),
    "hybrid8x8": ("hybrid", {"k": 8, "n": 8}, ("hybrid",)),
}
# row -> (store, loss); store None: CE only (alpha 0); "online": the teacher's full logits (the whole vocabulary)
ROWS = {  # in the order they run: the reference rows and the candidates within 48 bytes first
    "ce_only": (None, None),
    "full_kd_online": ("online", "full_kl"),
    "topk_tail_kl_k64": ("topk64", "topk_tail_kl"),
    "systematic_kl_n64": ("systematic64", "sampled_kl"),
    "hybrid_kl_k4_n16": ("hybrid4x16", "hybrid_kl"),
    "sampled_kl_n32": ("sampled32", "sampled_kl"),
    "sampled_kl_n64": ("sampled64", "sampled_kl"),
    "systematic_kl_n32": ("systematic32", "sampled_kl"),
    "topk_tail_kl_k8": ("topk8", "topk_tail_kl"),
    "hybrid_kl_k8_n8": ("hybrid8x8", "hybrid_kl"),
    "topk_kl_k64": ("topk64", "topk_kl"),
}
REFERENCE = "topk_tail_kl_k64"
BYTES_GOAL = 48.0
SETTINGS = ("fid_student_layers", "fid_student_width", "fid_docs", "fid_val_docs", "fid_test_docs", "fid_seq_len", "fid_batch", "fid_seeds", "fid_lr",
            "fid_warmup", "fid_eval_every", "fid_patience", "fid_tolerance", "fid_decay", "fid_decays",
            "fid_max_steps")


# ----------------------------------------------------------------------------- teacher, data, stores


def _teacher_suffix(size: dict) -> str:
    """The cache names' mark of a teacher other than the default one."""
    teacher = (size["fid_vocab"], float(size["fid_head_scale"]))
    return "" if teacher == DEFAULT_TEACHER else f"-v{teacher[0]}-x{teacher[1]:g}"


def _teacher(size: dict):
    from logit_distill.models import build_model, init_params

    cfg = model_config(size["fid_vocab"])
    params = init_params(cfg, 0, "float32")
    params["lm_head"]["weight"] = params["lm_head"]["weight"] * size["fid_head_scale"]
    return build_model(cfg, params, identity={"kind": "fidelity-teacher"})


def _documents(teacher, size: dict, cache: str) -> dict:
    """{train, val, test}: int32 [n, L] documents sampled from the teacher (cached)."""
    from logit_distill.sampling import sample_documents

    n = (size["fid_docs"], size["fid_val_docs"], size["fid_test_docs"])
    path = os.path.join(cache, f"docs-{n[0]}-{n[1]}-{n[2]}-{size['fid_seq_len']}{_teacher_suffix(size)}.npz")
    if not os.path.exists(path):
        log(f"fidelity: sampling {sum(n)} documents of {size['fid_seq_len']} tokens from the teacher "
            f"(vocab {teacher.vocab_size})")
        docs = np.stack(sample_documents(teacher, num_docs=sum(n), doc_len=size["fid_seq_len"], seed=0, bos_id=0))
        np.savez(path + ".tmp.npz", train=docs[:n[0]], val=docs[n[0]:n[0] + n[1]], test=docs[n[0] + n[1]:])
        os.replace(path + ".tmp.npz", path)
    with np.load(path) as f:
        return {k: f[k].astype(np.int32) for k in ("train", "val", "test")}


def _model_inputs(tokens: np.ndarray) -> dict:
    L = tokens.shape[-1]
    return {"tokens": tokens, "positions": np.broadcast_to(np.arange(L, dtype=np.int32), tokens.shape).copy(),
            "segment_ids": np.ones_like(tokens)}


def _select_fn(teacher, selection: str, settings: dict):
    """jitted ``(params, tokens, positions, segment_ids, example_index, seed) -> selection's fields``."""
    import jax

    from logit_distill import selection as topk

    def run(params, tokens, positions, segment_ids, example_index, seed):
        logits = teacher.apply(params, tokens, positions, segment_ids)
        keys = topk.sample_keys(seed, example_index, tokens.shape[1]) if selection != "topk" else None
        if selection == "topk":
            return topk.select_topk(logits, settings["k"])
        if selection == "sampled":
            return topk.select_sampled(logits, settings["n"], keys)
        if selection == "systematic":
            return topk.select_systematic(logits, settings["n"], keys)
        return topk.select_hybrid(logits, settings["k"], settings["n"], keys)

    return jax.jit(run, static_argnums=(5,))


def _encode(layout: str, rec: dict, n: int | None, index: int, V: int) -> bytes:
    """One example's record in ``layout``, by the store's codec (the default one): ``topk``, ``sampled``,
    ``hybrid`` (the head + the tail draws + ``tail_plogp``), or ``compact`` (a hybrid record without a head:
    the draws and the whole distribution's ``sum p log p``)."""
    from logit_distill import codec

    common = dict(example_index=index, tokens=rec["tokens"], segment_ids=rec["segment_ids"],
                  positions=rec["positions"], vocab_size=V)
    if layout == "topk":
        return codec.encode_record("default", **common, topk_ids=rec["topk_ids"], topk_logprobs=rec["topk_logprobs"],
                                   tail_logprob=rec["tail_logprob"])
    if layout == "sampled":
        return codec.encode_record("default", **common, sample_ids=rec["sample_ids"],
                                   sample_counts=rec["sample_counts"], sample_logprobs=rec["sample_logprobs"],
                                   num_samples=n)
    L = len(rec["tokens"])
    head = {"topk_ids": np.zeros((L, 0), np.int32), "topk_logprobs": np.zeros((L, 0), np.float32)} \
        if layout == "compact" else {k: rec[k] for k in ("topk_ids", "topk_logprobs", "tail_logprob")}
    return codec.encode_record("default", **common, **head, sample_ids=rec["sample_ids"],
                               sample_counts=rec["sample_counts"], tail_plogp=rec["tail_plogp"], num_samples=n)


TRAIN_FIELDS = ("topk_ids", "topk_logprobs", "tail_logprob", "sample_ids", "sample_counts", "sample_logprobs",
                "tail_plogp")


def _build_store(teacher, docs: np.ndarray, name: str, seed: int, cache: str, suffix: str) -> dict:
    """The store's decoded training fields (numpy ``[n, L, ...]``) and its bytes per position, per layout."""
    from logit_distill import codec

    selection, settings, layouts = STORES[name]
    V = teacher.vocab_size
    path = os.path.join(cache, f"store-{name}-seed{seed}-{docs.shape[0]}x{docs.shape[1]}{suffix}.npz")
    if os.path.exists(path):
        with np.load(path) as f:
            out = {k: f[k] for k in f.files if k != "bytes"}
            out["bytes"] = json.loads(str(f["bytes"]))
        return out
    fn = _select_fn(teacher, selection, settings)
    n, L = docs.shape
    fields: dict = {}
    total = {layout: 0 for layout in layouts}
    for start in range(0, n, 64):
        rows = _model_inputs(docs[start:start + 64])
        index = np.arange(start, start + len(rows["tokens"]), dtype=np.int32)
        sel = {k: np.asarray(v) for k, v in fn(teacher.params, *rows.values(), index, int(seed)).items()}
        for i in range(len(index)):
            rec = {**{k: v[i] for k, v in rows.items()}, **{k: v[i] for k, v in sel.items()}}
            for j, layout in enumerate(layouts):
                data = _encode(layout, rec, settings.get("n"), int(index[i]), V)
                total[layout] += len(data)
                if j == 0:  # train on what the first layout's decoder gives back
                    back = codec.decode_record(data)
                    for k in TRAIN_FIELDS:
                        if back.get(k) is not None:
                            fields.setdefault(k, []).append(back[k])
    out = {}
    for k, parts in fields.items():
        if parts[0].ndim == 2 and k.startswith("sample_"):  # ragged S per record: pad to the widest
            S = max(p.shape[1] for p in parts)
            parts = [np.pad(p, ((0, 0), (0, S - p.shape[1]))) for p in parts]
        out[k] = np.stack(parts)
    out["bytes"] = {layout: b / (n * L) for layout, b in total.items()}
    np.savez(path + ".tmp.npz", **{k: v for k, v in out.items() if k != "bytes"}, bytes=json.dumps(out["bytes"]))
    os.replace(path + ".tmp.npz", path)
    return out


def _teacher_stats(teacher, docs: np.ndarray) -> dict:
    import jax

    ent = top8 = top64 = 0.0
    npos = 0
    for start in range(0, len(docs), 64):
        rows = _model_inputs(docs[start:start + 64])
        lp = np.asarray(jax.nn.log_softmax(teacher.apply(teacher.params, *rows.values()), -1), np.float64)[:, :-1]
        p = np.exp(lp)
        srt = np.sort(p, -1)
        ent += float(-(p * lp).sum())
        top8 += float(srt[..., -8:].sum())
        top64 += float(srt[..., -64:].sum())
        npos += p.shape[0] * p.shape[1]
    return {"entropy_nats": ent / npos, "top8_mass": top8 / npos, "top64_mass": top64 / npos, "positions": npos}


# ----------------------------------------------------------------------------- training


def _row_key(name: str, size: dict) -> str:
    what = {"row": ROWS[name], "store": STORES.get(ROWS[name][0]), "settings": {k: size[k] for k in SETTINGS},
            "teacher": model_config(size["fid_vocab"]), "scale": float(size["fid_head_scale"]), "version": 3}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:12]


class _Trainer:
    """Training and evaluation functions of one student architecture, compiled once per loss kind."""

    def __init__(self, teacher, size: dict):
        import jax
        import jax.numpy as jnp
        import optax

        from logit_distill.train import teacher_metrics
        from logit_distill.train.losses import (cross_entropy_per_token, distill_loss, next_token_mask,
                                                next_token_targets)

        self.teacher = teacher
        self.config = student_config(size)
        self.student = common.build(self.config, 100)
        self.tx = optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(b1=0.9, b2=0.95))
        apply, tx = self.student.apply, self.tx
        self._steps: dict = {}

        def make_block(kind, alpha):
            """``E`` steps in one call (``lax.scan``): the training set and the stores' fields stay on
            the device; each step gathers its batch by index there, so the host does nothing per step."""

            def one(params, opt_state, batch, lr):
                def loss_fn(p):
                    z = apply(p, batch["tokens"], batch["positions"], batch["segment_ids"])
                    return distill_loss(z, batch, kind=kind, alpha=alpha, temperature=1.0)[0]

                value, grads = jax.value_and_grad(loss_fn)(params)
                updates, opt_state = tx.update(grads, opt_state, params)
                params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
                return params, opt_state, value

            def block(params, opt_state, data, fields, idx, lr):
                # data: {name: [n, L]}; fields: {name: [S, n, L, ...]}; idx: int32 [E, S, B]; lr: [E, S]
                def body(carry, x):
                    params, opt_state = carry
                    i, lr_t = x
                    batch = {k: v[i] for k, v in data.items()}  # [S, B, L]
                    for k, v in fields.items():
                        batch[k] = jax.vmap(lambda f, j: f[j])(v, i)
                    params, opt_state, _ = jax.vmap(one)(params, opt_state, batch, lr_t)
                    return (params, opt_state), None

                (params, opt_state), _ = jax.lax.scan(body, (params, opt_state), (idx, lr))
                return params, opt_state

            return jax.jit(block, donate_argnums=(0, 1))

        self._make_step = make_block

        @jax.jit
        def val_kl(params, tokens, positions, segment_ids, teacher_logits):  # [S] sums of KL, count
            z = jax.vmap(lambda p: apply(p, tokens, positions, segment_ids))(params)
            kl = jax.vmap(lambda zz: teacher_metrics.kl(teacher_logits, zz))(z)
            mask = next_token_mask(segment_ids)
            return jnp.sum(jnp.where(mask, kl, 0.0), axis=(1, 2)), jnp.sum(mask)

        @jax.jit
        def test_sums(params, tokens, positions, segment_ids):  # per seed: teacher_metrics.sums + CE
            t = teacher.apply(teacher.params, tokens, positions, segment_ids)

            def one(p):
                z = apply(p, tokens, positions, segment_ids)
                values = teacher_metrics.per_position(z, {"teacher_logits": t}, k=TAIL_SHAPE_K)
                values["cross_entropy"] = cross_entropy_per_token(z, next_token_targets(tokens))
                return teacher_metrics.sums(values, next_token_mask(segment_ids))

            return jax.vmap(one)(params)

        @jax.jit
        def keep_best(best, params, improved):
            return jax.tree.map(lambda b, p: jnp.where(improved.reshape((-1,) + (1,) * (p.ndim - 1)), p, b),
                                best, params)

        self.val_kl, self.test_sums, self.keep_best = val_kl, test_sums, keep_best
        self._teacher_fn = jax.jit(lambda tokens, positions, segment_ids: teacher.apply(
            teacher.params, tokens, positions, segment_ids))

    def teacher_logits(self, docs: np.ndarray):
        """The teacher's logits ``[n, L, V]`` over ``docs`` (on the device), 64 documents a call."""
        import jax.numpy as jnp

        rows = _model_inputs(docs)
        return jnp.concatenate([self._teacher_fn(*{k: v[s:s + 64] for k, v in rows.items()}.values())
                                for s in range(0, len(docs), 64)])

    def step_fn(self, kind, alpha):
        key = (kind, alpha)
        if key not in self._steps:
            self._steps[key] = self._make_step(kind, alpha)
        return self._steps[key]


def _stack(trees):
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda *x: jnp.stack(x), *trees)


def _train_row(trainer: _Trainer, name: str, size: dict, docs: dict, stores: dict, val_teacher) -> dict:
    """Train the row's seeds together until each has converged (the stopping rule); test metrics at
    each seed's best validation step, and the validation curve."""
    import jax
    import jax.numpy as jnp

    store, loss = ROWS[name]
    S, B = size["fid_seeds"], size["fid_batch"]
    kind, alpha = (loss, 1.0) if loss else ("topk_kl", 0.0)
    step = trainer.step_fn(kind, alpha)
    params = _stack([common.build(trainer.config, 100 + s).params for s in range(S)])
    opt_state = jax.vmap(trainer.tx.init)(params)
    best = jax.tree.map(jnp.copy, params)
    train = docs["train"]
    n, L = train.shape
    base = _model_inputs(train)
    fields = {}
    if store not in (None, "online"):
        per_seed = [stores[(store, s)] for s in range(S)]
        from logit_distill.train.losses import FIELDS

        for k in FIELDS[kind] + ("tail_plogp",):
            if k in per_seed[0] and not (k == "sample_logprobs" and "tail_plogp" in per_seed[0]):
                parts = [st[k] for st in per_seed]
                if k.startswith("sample_"):  # each seed's store has its own widest position
                    width = max(x.shape[-1] for x in parts)
                    parts = [np.pad(x, ((0, 0), (0, 0), (0, width - x.shape[-1]))) for x in parts]
                fields[k] = np.stack(parts)  # [S, n, L, ...]
    orders = [np.random.default_rng(1000 + s) for s in range(S)]
    perms = [o.permutation(n) for o in orders]
    cursor = 0
    lr0, warmup = size["fid_lr"], size["fid_warmup"]
    scale = np.ones(S)
    best_val = np.full(S, np.inf)
    since, cuts, done = np.zeros(S, int), np.zeros(S, int), np.zeros(S, bool)
    best_step, stopped_at = np.zeros(S, int), np.zeros(S, int)
    curve = []
    val = _model_inputs(docs["val"])
    t0, cpu0 = time.perf_counter(), time.process_time()
    data = {k: jnp.asarray(v) for k, v in base.items()}
    if store == "online":  # the teacher's full logits over the training documents, computed once
        data["teacher_logits"] = trainer.teacher_logits(train)
    fields = {k: jnp.asarray(v) for k, v in fields.items()}
    E = size["fid_eval_every"]
    steps = 0
    while steps < size["fid_max_steps"]:
        block = range(steps + 1, min(steps + E, size["fid_max_steps"]) + 1)
        idx, lr = [], []
        for t in block:  # the same order and schedule as one step at a time
            if cursor + B > n:
                perms = [o.permutation(n) for o in orders]
                cursor = 0
            idx.append(np.stack([p[cursor:cursor + B] for p in perms]))  # [S, B]
            cursor += B
            lr.append(lr0 * min(1.0, t / warmup) * scale * ~done)
        params, opt_state = step(params, opt_state, data, fields, jnp.asarray(np.stack(idx), jnp.int32),
                                 jnp.asarray(np.stack(lr), jnp.float32))
        steps = block[-1]
        if steps % E:
            break
        total, count = 0.0, 0
        for start in range(0, len(docs["val"]), 64):
            part = {k: v[start:start + 64] for k, v in val.items()}
            s_kl, c = trainer.val_kl(params, *part.values(), val_teacher[start:start + 64])
            total, count = total + np.asarray(s_kl, np.float64), count + int(c)
        v = total / count
        curve.append([steps, [float(x) for x in v]])
        improved = (v < best_val * (1 - size["fid_tolerance"])) & ~done
        best = trainer.keep_best(best, params, jnp.asarray(v < best_val) & jnp.asarray(~done))
        best_step = np.where((v < best_val) & ~done, steps, best_step)
        best_val = np.where(~done, np.minimum(best_val, v), best_val)
        since = np.where(improved, 0, since + 1)
        plateau = (since >= size["fid_patience"]) & ~done
        finished = plateau & (cuts >= size["fid_decays"])
        cut = plateau & ~finished
        scale = np.where(cut, scale * size["fid_decay"], scale)
        cuts, since = cuts + cut, np.where(cut, 0, since)
        stopped_at = np.where(finished, steps, stopped_at)
        done |= finished
        if len(curve) % 10 == 0:
            log(f"fidelity: {name}: step {steps}, validation KL {', '.join(f'{x:.4f}' for x in v)}, "
                f"learning-rate cuts {cuts.tolist()}, converged {done.tolist()}")
        if done.all():
            break
    train_s, train_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    stopped_at = np.where(done, stopped_at, steps)
    sums = None
    test = _model_inputs(docs["test"])
    for start in range(0, len(docs["test"]), 64):
        part = {k: v[start:start + 64] for k, v in test.items()}
        out = {k: np.asarray(v, np.float64) for k, v in trainer.test_sums(best, *part.values()).items()}
        sums = out if sums is None else {k: sums[k] + out[k] for k in sums}
    metrics = {k: [float(x) for x in sums[k] / sums["count"]] for k in sums if k != "count"}
    return {"test": metrics, "test_positions": int(sums["count"][0]), "val_curve": curve,
            "best_val_kl": [float(x) for x in best_val], "best_step": [int(x) for x in best_step],
            "stopped_at": [int(x) for x in stopped_at], "converged": [bool(x) for x in done],
            "lr_cuts": [int(x) for x in cuts], "train_seconds": train_s, "train_cpu_seconds": train_cpu_s,
            "steps_run": steps}


# ----------------------------------------------------------------------------- the table


def _paired(a: list, b: list) -> dict:
    d = np.asarray(a) - np.asarray(b)
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("nan")
    return {"mean": float(d.mean()), "se": se}


def _table(results: dict, stores_bytes: dict) -> dict:
    ref = results[REFERENCE]["test"]["kl"]
    ce, full = np.asarray(results["ce_only"]["test"]["kl"]), np.asarray(results["full_kd_online"]["test"]["kl"])
    ref_bytes = stores_bytes[ROWS[REFERENCE][0]]["topk"]
    table = {}
    for name, r in results.items():
        store, loss = ROWS[name]
        kl = np.asarray(r["test"]["kl"])
        gap = (ce - kl) / (ce - full)
        b = stores_bytes.get(store, {})
        row = {
            "loss": loss or "ce (alpha 0)",
            "bytes_per_position": b or None,
            "bytes_over_reference": {k: v / ref_bytes for k, v in b.items()} or None,
            "heldout_kl": float(kl.mean()),
            "heldout_kl_per_seed": [float(x) for x in kl],
            "kl_minus_reference": _paired(kl, ref),
            "gap_closed": {"mean": float(gap.mean()),
                           "se": float(gap.std(ddof=1) / math.sqrt(len(gap))) if len(gap) > 1 else float("nan")},
        }
        for metric in ("cross_entropy", "tail_shape_kl", "top1_agreement", "topk_mass"):
            row[f"heldout_{metric}"] = float(np.mean(r["test"][metric]))
        row["convergence"] = {k: r[k] for k in ("stopped_at", "best_step", "converged", "lr_cuts", "steps_run")}
        row["train_seconds"] = r["train_seconds"]
        row["train_cpu_seconds"] = r["train_cpu_seconds"]
        table[name] = row
    return table


def _checks(table: dict) -> dict:
    """The goal: a store of <= 48 bytes per position whose held-out KL is no worse than the reference's
    (paired mean difference <= 2 standard errors) and that closes >= 0.95 of the gap."""
    winners = {}
    for name, row in table.items():
        if not row["bytes_per_position"] or name == REFERENCE:
            continue
        smallest = min(row["bytes_per_position"].values())
        d = row["kl_minus_reference"]
        if smallest <= BYTES_GOAL:
            winners[name] = {"bytes": smallest, "kl_minus_reference": d, "gap_closed": row["gap_closed"]["mean"],
                             "no_worse": d["mean"] <= 2 * d["se"], "closes_95": row["gap_closed"]["mean"] >= 0.95}
    met = [k for k, w in winners.items() if w["no_worse"] and w["closes_95"]]
    return {"rows_within_bytes_goal": winners, "goal_met_by": met,
            "every_kd_row_beats_ce_only": all(v["heldout_kl"] < table["ce_only"]["heldout_kl"]
                                              for k, v in table.items() if k != "ce_only"),
            "every_row_converged": all(all(v["convergence"]["converged"]) for v in table.values())}


def fidelity(size: dict, rows: list[str] | None = None) -> dict:
    import jax

    t_start = time.perf_counter()
    out_dir = os.path.join(common.OUT, "fidelity")
    cache, rows_dir = os.path.join(out_dir, "cache"), os.path.join(out_dir, "rows")
    os.makedirs(cache, exist_ok=True)
    os.makedirs(rows_dir, exist_ok=True)
    rows = list(rows or size.get("fid_rows") or ROWS)
    for required in ("ce_only", "full_kd_online", REFERENCE):
        if required not in rows:
            rows.insert(0, required)
    teacher = _teacher(size)
    docs = _documents(teacher, size, cache)
    stats = _teacher_stats(teacher, docs["test"])
    log(f"fidelity: teacher on the test documents: entropy {stats['entropy_nats']:.2f} nats, top-64 mass "
        f"{stats['top64_mass']:.3f}")
    val = _model_inputs(docs["val"])
    val_teacher = np.concatenate([np.asarray(teacher.apply(teacher.params, *{k: v[s:s + 64] for k, v in val.items()}
                                                           .values())) for s in range(0, len(docs["val"]), 64)])
    val_teacher = jax.device_put(val_teacher)
    trainer = _Trainer(teacher, size)
    results, stores, stores_bytes = {}, {}, {}
    for name in rows:
        store = ROWS[name][0]
        if store not in (None, "online"):
            for s in range(size["fid_seeds"]):
                seed = s if STORES[store][0] != "topk" else 0
                if (store, s) not in stores:
                    t0 = time.perf_counter()
                    stores[(store, s)] = _build_store(teacher, docs["train"], store, seed, cache, _teacher_suffix(size))
                    if time.perf_counter() - t0 > 5:
                        log(f"fidelity: store {store} (seed {seed}) built in {time.perf_counter() - t0:.0f} s")
            stores_bytes[store] = stores[(store, 0)]["bytes"]
        path = os.path.join(rows_dir, f"{name}-{_row_key(name, size)}.json")
        if os.path.exists(path):
            with open(path) as f:
                results[name] = json.load(f)
            log(f"fidelity: {name}: reused {path}")
            continue
        r = _train_row(trainer, name, size, docs, stores, val_teacher)
        with open(path + ".tmp", "w") as f:
            json.dump(r, f)
        os.replace(path + ".tmp", path)
        results[name] = r
        log(f"fidelity: {name}: test KL {np.mean(r['test']['kl']):.4f} (per seed "
            f"{', '.join(f'{x:.4f}' for x in r['test']['kl'])}), stopped at {r['stopped_at']}, "
            f"{r['train_seconds']:.0f} s ({r['train_cpu_seconds']:.0f} s of CPU)")
        later = {ROWS[r][0] for r in rows[rows.index(name) + 1:]}
        for key in [k for k in stores if k[0] not in later]:
            del stores[key]  # a store no later row reads
    table = _table(results, stores_bytes)
    return {
        "fidelity": {
            "value": table,
            "details": {
                "checks": _checks(table),
                "reference": REFERENCE,
                "teacher": f"Qwen3-style, 2 layers, width 64, vocab {size['fid_vocab']}, LM head "
                           f"x{size['fid_head_scale']:g}",
                "student": f"Qwen3-style, {size['fid_student_layers']} layer(s), width {size['fid_student_width']}, "
                           "its own random init per seed",
                "teacher_test_entropy_nats": stats["entropy_nats"],
                "teacher_test_top8_mass": stats["top8_mass"],
                "teacher_test_top64_mass": stats["top64_mass"],
                "test_positions": stats["positions"],
                "settings": {k: size[k] for k in SETTINGS},
                "stopping_rule": (
                    f"every {size['fid_eval_every']} steps the validation KL(teacher || student) over the full "
                    f"vocabulary; {size['fid_patience']} evaluations without a relative improvement of "
                    f"{size['fid_tolerance']:g} on the best is a plateau; a plateau multiplies the learning rate "
                    f"by {size['fid_decay']:g}; the plateau after {size['fid_decays']} cuts stops the seed; "
                    f"figures at each seed's best validation step (at most {size['fid_max_steps']} steps)"),
                "curves": {name: r["val_curve"] for name, r in results.items()},
                "bytes": "encoded record bytes / positions (header, runs and tokens included); 'compact': the "
                         "same draws without their log-probs, with the teacher's sum p log p per position",
                "spread": "paired by seed: mean over seeds of (row - reference) and its standard error; a seed "
                          "sets the student's init, its shuffle and the draws of a sampled store",
                "seconds": {"total": time.perf_counter() - t_start,
                            **{k: round(r["train_seconds"], 1) for k, r in results.items()}},
                "cpu_seconds": {k: round(r["train_cpu_seconds"], 1) for k, r in results.items()},
            },
        }
    }


def main(argv=None) -> int:
    """``python -m bench.fidelity_bench [--rows a,b] [--set key=value ...]``: the group alone, printing
    the table as JSON (bench.run --only fidelity writes it to bench/results.json)."""
    import argparse

    from .sizes import SIZES

    p = argparse.ArgumentParser(prog="python -m bench.fidelity_bench")
    p.add_argument("--rows", default=None)
    p.add_argument("--full", action="store_true")
    p.add_argument("--set", action="append", default=[], help="key=value overriding a fid_* size")
    p.add_argument("--out", default=None, help="write the result JSON here")
    args = p.parse_args(argv)
    size = dict(SIZES["full" if args.full else "quick"])
    for item in args.set:
        key, value = item.split("=", 1)
        size[key] = type(size[key])(value) if key in size else json.loads(value)
    result = fidelity(size, args.rows.split(",") if args.rows else None)
    text = json.dumps(result, indent=1, default=float)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(json.dumps({k: {m: v[m] for m in ("heldout_kl", "kl_minus_reference", "gap_closed", "bytes_per_position",
                                             "heldout_tail_shape_kl", "heldout_top1_agreement")}
                      for k, v in result["fidelity"]["value"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    common.setup_environment()
    raise SystemExit(main())
