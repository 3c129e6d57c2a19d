"""Where a run's examples come from, offline or online, as one object: ``open_source(config)``.

Offline the examples are a logit store's records (``Store`` is a Grain random-access source); online
they are the data's examples (``loader.OnlineSource``) and the teacher runs on each batch in the
loop, as the dump runs it (the same selection, the same draws). Either way the run sees the same
``TrainSource``: the vocabulary, sequence length and packing of the data, the tokenizer the data was
tokenized with (students are checked against it), the part of the run's identity that names the
data, and, for the loader, the fields a batch carries.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ..errors import InputError
from . import loader
from .config import TrainConfig
from .losses import FIELDS, representation


@dataclasses.dataclass
class TrainSource:
    mode: str  # "offline" | "online"
    records: Any  # a Grain random-access source of example dicts
    where: str  # "store S" / "teacher T", for messages
    selection: str  # "topk" | "sampled" | "hybrid"
    top_k: int  # k, or the draws per position N of a sampled selection
    vocab_size: int
    seq_len: int
    packing: bool
    text_field: str  # of the data (and the default of --eval-data's)
    chat: Any  # ChatOptions the data was read with (and --eval-data is read with, unless the config gives its own)
    tokenizer_file: str | None  # local tokenizer.json the data was tokenized with
    tokenizer_sha256: str | None
    identity: dict  # the data's part of the run's identity (train_config.json)
    manifest: dict | None = None  # offline
    teacher_spec: str | None = None  # online
    teacher: Any = None  # online: the LoadedModel, once ``load_teacher`` ran
    num_examples: int = 0  # examples of the data (a planned store's: every step's)

    def load_teacher(self):
        """Online: the teacher's weights (the plan reads only its config)."""
        if self.teacher_spec is not None and self.teacher is None:
            from ..models import load_model

            self.teacher = load_model(self.teacher_spec)
            if self.teacher.identity != self.identity["teacher"]:
                raise InputError(f"teacher {self.teacher_spec} changed while it was being loaded; run again")
        return self.teacher

    def __len__(self) -> int:
        return self.num_examples

    def proposal_temperature(self, config: TrainConfig) -> float:
        if self.manifest is not None and self.selection in ("sampled", "hybrid"):
            return float(self.manifest["shapes"]["proposal_temperature"])
        return float(config.proposal_temperature)

    def tempered(self, loss: str, temperature: float) -> bool:
        """Whether the loss needs the tail mass tempered at ``temperature`` (a topk_tail_* or hybrid loss at
        T != 1)."""
        return representation(loss) in ("topk_tail", "hybrid") and float(temperature) != 1.0

    def batch_fields(self, loss: str, temperature: float) -> tuple:
        return loader.MODEL_FIELDS + FIELDS[loss] + (("tail_logprob_tempered",) if self.tempered(loss, temperature)
                                                      else ())

    def loader_options(self, loss: str, temperature: float) -> dict:
        """``loader.build_dataset``'s options for this source: sampled records padded to the store's N, the
        tempered tail column of the training temperature, and the record check."""
        if self.manifest is None:
            return {}
        from ..store import manifest as manifest_mod
        from ..store.checks import RecordCheck

        options: dict = {"check": RecordCheck(self.manifest, self.records.uri)}  # (a store that exists)
        if self.tempered(loss, temperature):
            options["tempered_index"] = manifest_mod.tail_temperatures_of(self.manifest).index(float(temperature))
        if self.selection in ("sampled", "hybrid"):  # records of varying slots: padded to N
            options["sample_width"] = int(self.manifest["shapes"]["num_samples"])
        return options

    def teacher_function(self, config: TrainConfig, loss: str) -> Callable | None:
        """Online: the teacher's selection for ``loss``, as the dump computes it
        (``fn(params, tokens, positions, segment_ids, example_index) -> dict`` of the loss's fields;
        sampled: ``example_index`` keys the draws, ``epochs.draw_index`` gives each epoch its own)."""
        if self.teacher is None:
            return None
        from ..selection import make_teacher_sampled, make_teacher_topk

        if representation(loss) == "full":  # the whole vocabulary
            apply = self.teacher.apply
            return lambda params, tokens, positions, segment_ids, _index: {
                "teacher_logits": apply(params, tokens, positions, segment_ids)}
        if representation(loss) == "sampled":  # the dump's draws: keyed by (data seed, example index, position)
            return make_teacher_sampled(self.teacher.apply, int(config.samples), seed=int(config.data_seed),
                                        proposal_temperature=config.proposal_temperature)
        tempered = self.tempered(loss, config.temperature)
        fn = make_teacher_topk(self.teacher.apply, int(config.top_k),
                               tail_temperatures=(float(config.temperature),) if tempered else ())
        if not tempered:
            return fn

        def teacher_fn(*args):
            out = fn(*args)
            out["tail_logprob_tempered"] = out["tail_logprob_tempered"][..., 0]
            return out

        return teacher_fn


def open_source(config: TrainConfig) -> TrainSource:
    """The run's examples (offline: the store, opened and scanned; online: the teacher's config and
    tokenizer, and the data, tokenized; its weights load with ``load_teacher``). Raises before any
    step when they do not fit the config."""
    return _online(config) if config.online else _offline(config)


def _offline(config: TrainConfig) -> TrainSource:
    from ..data import ChatOptions
    from ..store import manifest as manifest_mod
    from ..store import open_store

    store = open_store(config.store)
    manifest = store.manifest
    shapes = manifest["shapes"]
    data = manifest.get("content", {}).get("data", {})
    return TrainSource(
        mode="offline", records=store, where=f"store {config.store}", selection=manifest_mod.selection_of(manifest),
        top_k=int(shapes["top_k"]), vocab_size=int(shapes["vocab_size"]), seq_len=int(shapes["seq_len"]),
        packing=bool(data.get("packing", True)), text_field=config.text_field or data.get("text_field") or "text",
        chat=ChatOptions.from_identity(data.get("chat")), tokenizer_file=store.tokenizer_file(),
        tokenizer_sha256=manifest_mod.tokenizer_sha256(manifest),
        identity={"mode": "offline", "store_fingerprint": manifest["fingerprint"]}, manifest=manifest,
        num_examples=len(store),
    )


def planned_source(config: TrainConfig, manifest: dict, tokenizer_file: str | None) -> TrainSource:
    """The source a store of ``manifest`` will be once dumped (a dump's plan): what training on it can be
    checked against before the store exists (``records`` is None; a pipeline's preflight)."""
    from ..data import ChatOptions
    from ..store import manifest as manifest_mod

    shapes, data = manifest["shapes"], manifest.get("content", {}).get("data", {})
    return TrainSource(
        mode="offline", records=None, where=f"store {config.store}", selection=manifest_mod.selection_of(manifest),
        top_k=int(shapes["top_k"]), vocab_size=int(shapes["vocab_size"]), seq_len=int(shapes["seq_len"]),
        packing=bool(data.get("packing", True)), text_field=config.text_field or data.get("text_field") or "text",
        chat=ChatOptions.from_identity(data.get("chat")), tokenizer_file=tokenizer_file, tokenizer_sha256=manifest_mod.tokenizer_sha256(manifest),
        identity={"mode": "offline", "store_fingerprint": manifest["fingerprint"]}, manifest=manifest,
        num_examples=manifest_mod.num_examples(manifest),
    )


def _online(config: TrainConfig) -> TrainSource:
    from ..data import ChatOptions, ExampleSource
    from ..models import describe_model

    hf_config, teacher_identity, teacher_tokenizer = describe_model(config.teacher)
    V = int(hf_config["vocab_size"])
    top_k = int(config.samples if config.top_k is None else config.top_k) if (
        config.top_k is not None or config.samples is not None) else V  # full_*: the whole vocabulary
    if not 0 < top_k <= V:
        raise InputError(f"--top-k {top_k} must be in [1, {V}] (the teacher's vocabulary)")
    if config.loss is not None and representation(config.loss) == "topk_tail" and top_k >= V:
        raise InputError(f"--loss {config.loss} needs tail mass, but --top-k {top_k} covers the teacher's whole "
                         f"vocabulary ({V}): there is no tail; use --loss topk_kl")
    text_field = config.text_field or "text"
    max_len = int(hf_config.get("max_position_embeddings") or 0)
    if max_len and config.seq_len > max_len:
        raise InputError(f"--seq-len {config.seq_len} exceeds the teacher's maximum of {max_len} positions")
    chat = config.chat or ChatOptions()
    examples = ExampleSource.open(config.data, teacher_tokenizer, seq_len=int(config.seq_len),
                                  packing=bool(config.packing), seed=int(config.data_seed), text_field=text_field,
                                  chat=chat)
    examples.check_vocab(V)
    records = loader.OnlineSource(examples, config.num_examples)
    return TrainSource(
        mode="online", records=records, where=f"teacher {config.teacher}",
        selection="sampled" if config.samples is not None else "topk", top_k=top_k, vocab_size=V,
        seq_len=int(config.seq_len), packing=bool(config.packing), text_field=text_field, chat=chat,
        tokenizer_file=teacher_tokenizer, tokenizer_sha256=examples.identity.get("tokenizer_sha256"),
        identity={"mode": "online", "teacher": teacher_identity, "data": examples.identity, "top_k": top_k,
                  "num_examples": len(records)},
        teacher_spec=config.teacher, num_examples=len(records),
    )
