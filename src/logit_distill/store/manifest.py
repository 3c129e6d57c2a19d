"""The store manifest: format version, shapes, codec, layout, content settings, fingerprint.

Every setting that changes the bytes of the store lives under ``shapes``,
``codec``, ``layout`` or ``content``; the fingerprint is the SHA-256 of their
canonical JSON. ``info`` (creation time, version) is not fingerprinted.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math

from .. import __version__
from .. import codec as codec_mod
from ..errors import ConfigMismatchError, StoreError

FORMAT = "logit-distill-store"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
# A copy of the tokenizer.json the data was tokenized with; its SHA-256 is content.data.tokenizer_sha256.
TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"  # beside it: the EOS token
CHAT_TEMPLATE_NAME = "chat_template.jinja"  # beside them: the template a chat data set was rendered with
FINGERPRINTED = ("shapes", "codec", "layout", "content")
# What a store's records hold (``codec.SELECTION_FIELDS``): top-k + tail, sampled ids + counts, or both
# (an exact top-k head plus draws from the rest).
SELECTIONS = tuple(codec_mod.SELECTION_FIELDS)
DEFAULT_ARRAY_RECORD_OPTIONS = "group_size:1,uncompressed"


def canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def fingerprint_of(manifest: dict) -> str:
    body = {key: manifest[key] for key in FINGERPRINTED}
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


def dump_key(manifest: dict) -> str:
    """The short name of a store configuration (first 16 hex digits of its fingerprint)."""
    return manifest["fingerprint"][:16]


def store_tag(manifest: dict) -> int:
    """The 32-bit tag written into every record: the first 4 bytes of the fingerprint."""
    return int(manifest["fingerprint"][:8], 16)


def build_manifest(
    *,
    seq_len: int,
    top_k: int,
    vocab_size: int,
    codec: str,
    num_steps: int,
    examples_per_step: int,
    steps_per_file: int,
    num_processes: int = 1,
    content: dict | None = None,
    array_record_options: str = DEFAULT_ARRAY_RECORD_OPTIONS,
    selection: str = "topk",
    num_samples: int | None = None,
    proposal_temperature: float = 1.0,
    sample_seed: int = 0,
    tail_temperatures=(),
    masked: bool = False,
) -> dict:
    """A complete manifest with its fingerprint. ``content`` holds teacher, data and other settings.

    ``selection="sampled"`` records ``num_samples`` (N draws per position),
    ``proposal_temperature`` and ``sample_seed`` under ``shapes``, with
    ``top_k = N`` (the most distinct ids a position can hold); a top-k store
    may record ``tail_temperatures``. A plain top-k store has neither key, so
    its fingerprint is what it was before sampled stores existed.

    ``selection="hybrid"`` records the head's ``top_k`` (<= 255, below the vocabulary), ``num_samples``
    (the tail draws per position), ``proposal_temperature`` and ``sample_seed``; at a proposal
    temperature t != 1 its ``tail_temperatures`` are ``[t]`` (its records hold the tail mass at t).

    ``masked``: records hold the teacher's values at supervised positions only (``shapes.masked``;
    what the dump writes). A store without the key holds every position (the earlier layout).
    """
    if selection not in SELECTIONS:
        raise ValueError(f"unknown selection {selection!r}; known: {', '.join(SELECTIONS)}")
    if selection == "hybrid":
        if num_samples is None or int(num_samples) < 1:
            raise ValueError(f"a hybrid store needs num_samples >= 1, got {num_samples}")
        if not 1 <= int(top_k) <= codec_mod.MAX_HYBRID_K or int(top_k) >= int(vocab_size):
            raise ValueError(f"a hybrid store's head needs 1 <= top_k <= {codec_mod.MAX_HYBRID_K} and below the "
                             f"vocabulary of {vocab_size}, got {top_k}")
        if [float(T) for T in tail_temperatures] != ([] if float(proposal_temperature) == 1.0
                                                     else [float(proposal_temperature)]):
            raise ValueError("a hybrid store's tail temperatures are its proposal temperature's (none at 1)")
    if selection == "sampled":
        if num_samples is None or int(num_samples) < 1:
            raise ValueError(f"a sampled store needs num_samples >= 1, got {num_samples}")
        if tail_temperatures:
            raise ValueError("tail temperatures belong to top-k stores, not sampled ones")
        top_k = int(num_samples)
    if not all(float(T) > 0 for T in tail_temperatures) or len(tail_temperatures) > 255:
        raise ValueError(f"tail temperatures must be > 0 (at most 255), got {list(tail_temperatures)}")
    if codec not in codec_mod.CODEC_IDS:
        raise ValueError(f"unknown codec {codec!r}; known: {sorted(codec_mod.CODEC_IDS)}")
    for name, value in [
        ("seq_len", seq_len), ("top_k", top_k), ("vocab_size", vocab_size), ("num_steps", num_steps),
        ("examples_per_step", examples_per_step), ("steps_per_file", steps_per_file),
        ("num_processes", num_processes),
    ]:
        if int(value) < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if examples_per_step % num_processes:
        raise ValueError(
            f"examples_per_step={examples_per_step} is not divisible by num_processes={num_processes}"
        )
    if top_k > vocab_size and selection != "sampled":
        raise ValueError(f"top_k={top_k} exceeds vocab_size={vocab_size}")
    codec_info = {"name": codec, "array_record_options": array_record_options}
    if codec == "default":
        codec_info.update(
            id_bits=codec_mod.id_bits_for(vocab_size),
            logprob_scale=codec_mod.LOGPROB_SCALE,
            logprob_floor=codec_mod.LOGPROB_FLOOR,
        )
        if selection == "sampled":
            codec_info.update(sampled_layout=codec_mod.SAMPLED_LAYOUT,
                              sampled_logprob_scale=codec_mod.SAMPLED_LOGPROB_SCALE)
        if selection == "hybrid":
            codec_info.update(hybrid_layout=codec_mod.HYBRID_LAYOUT)
    shapes = {"seq_len": int(seq_len), "top_k": int(top_k), "vocab_size": int(vocab_size)}
    if selection == "sampled":
        shapes.update(selection="sampled", num_samples=int(num_samples),
                      proposal_temperature=float(proposal_temperature), sample_seed=int(sample_seed))
    elif selection == "hybrid":
        shapes.update(selection="hybrid", num_samples=int(num_samples),
                      proposal_temperature=float(proposal_temperature), sample_seed=int(sample_seed))
    if tail_temperatures:
        shapes["tail_temperatures"] = [float(T) for T in tail_temperatures]
    if masked:
        shapes["masked"] = True
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "shapes": shapes,
        "codec": codec_info,
        "layout": {
            "num_steps": int(num_steps),
            "examples_per_step": int(examples_per_step),
            "steps_per_file": int(steps_per_file),
            "num_processes": int(num_processes),
        },
        "content": content or {},
    }
    # Round-trip through JSON so that the in-memory manifest equals what a reader parses.
    manifest = json.loads(canonical_json(manifest))
    manifest["fingerprint"] = fingerprint_of(manifest)
    manifest["info"] = {
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "logit_distill_version": __version__,
    }
    return manifest


def manifest_bytes(manifest: dict) -> bytes:
    return (json.dumps(manifest, sort_keys=True, indent=2, allow_nan=False) + "\n").encode()


def parse_manifest(data: bytes, where: str) -> dict:
    """Parse and check a manifest read from ``where``; raise StoreError naming the problem."""
    try:
        manifest = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StoreError(f"{where}: manifest is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise StoreError(f"{where}: not a logit-distill store manifest (format={manifest.get('format')!r})"
                         if isinstance(manifest, dict) else f"{where}: manifest is not a JSON object")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise StoreError(
            f"{where}: unknown store format version {version!r}; this logit-distill "
            f"({__version__}) reads version {FORMAT_VERSION}"
        )
    missing = [key for key in (*FINGERPRINTED, "fingerprint") if key not in manifest]
    if missing:
        raise StoreError(f"{where}: manifest lacks {', '.join(missing)}")
    check_self_consistent(manifest, where)
    return manifest


def check_self_consistent(manifest: dict, where: str) -> None:
    """The fingerprint matches the settings and the shapes and layout make sense."""
    problems = []
    if fingerprint_of(manifest) != manifest["fingerprint"]:
        problems.append("fingerprint does not match the settings (the manifest was edited)")
    shapes, layout, codec_info = manifest["shapes"], manifest["layout"], manifest["codec"]
    try:
        for key in ("seq_len", "top_k", "vocab_size"):
            if int(shapes[key]) < 1:
                problems.append(f"shapes.{key} must be >= 1")
        for key in ("num_steps", "examples_per_step", "steps_per_file", "num_processes"):
            if int(layout[key]) < 1:
                problems.append(f"layout.{key} must be >= 1")
        if int(layout["examples_per_step"]) % int(layout["num_processes"]):
            problems.append("layout.examples_per_step is not divisible by layout.num_processes")
        if int(shapes["top_k"]) > int(shapes["vocab_size"]) and shapes.get("selection") != "sampled":
            problems.append("shapes.top_k exceeds shapes.vocab_size")
        if shapes.get("selection", "topk") not in SELECTIONS:
            problems.append(f"unknown shapes.selection {shapes.get('selection')!r}")
        elif shapes.get("selection") == "hybrid" and (
                int(shapes.get("num_samples", 0)) < 1 or int(shapes["top_k"]) > codec_mod.MAX_HYBRID_K
                or int(shapes["top_k"]) >= int(shapes["vocab_size"])):
            problems.append(f"a hybrid store needs shapes.num_samples >= 1 and shapes.top_k <= "
                            f"{codec_mod.MAX_HYBRID_K}, below shapes.vocab_size")
        elif shapes.get("selection") == "sampled" and (
                int(shapes.get("num_samples", 0)) < 1 or int(shapes["top_k"]) != int(shapes["num_samples"])):
            problems.append("a sampled store needs shapes.num_samples >= 1 equal to shapes.top_k")
        if shapes.get("masked", False) is not True and "masked" in shapes:
            problems.append(f"shapes.masked must be true when present, got {shapes['masked']!r}")
        if codec_info.get("name") not in codec_mod.CODEC_IDS:
            problems.append(f"unknown codec {codec_info.get('name')!r}")
        elif codec_info["name"] == "default" and codec_info.get("id_bits") != codec_mod.id_bits_for(
            shapes["vocab_size"]
        ):
            problems.append("codec.id_bits does not match shapes.vocab_size")
    except (KeyError, TypeError, ValueError) as e:
        problems.append(f"malformed field ({e!r})")
    if problems:
        raise StoreError(f"{where}: inconsistent manifest: " + "; ".join(problems))


def selection_of(manifest: dict) -> str:
    """``"topk"``, ``"sampled"`` or ``"hybrid"`` (stores without the key are top-k)."""
    return manifest["shapes"].get("selection", "topk")


def entries_per_position(manifest: dict) -> int:
    """The most ids a position's record can hold: ``top_k`` (a sampled store: N), a hybrid store's head
    ``k`` plus its ``N`` draws; the ``bytes_per_entry`` figures divide by it."""
    shapes = manifest["shapes"]
    return int(shapes["top_k"]) + (int(shapes["num_samples"]) if selection_of(manifest) == "hybrid" else 0)


def masked_of(manifest: dict) -> bool:
    """Whether the store's records hold the teacher's values at supervised positions only."""
    return bool(manifest["shapes"].get("masked", False))


def tail_temperatures_of(manifest: dict) -> list[float]:
    """The temperatures whose tempered tail mass a top-k store holds (``[]`` if none)."""
    return [float(T) for T in manifest["shapes"].get("tail_temperatures", [])]


def tokenizer_sha256(manifest: dict) -> str | None:
    """The SHA-256 of the tokenizer.json the store's data was tokenized with (None: not recorded)."""
    content = manifest.get("content")
    data = content.get("data") if isinstance(content, dict) else None
    value = data.get("tokenizer_sha256") if isinstance(data, dict) else None
    return value if isinstance(value, str) else None


def num_files(manifest: dict) -> int:
    layout = manifest["layout"]
    return math.ceil(layout["num_steps"] / layout["steps_per_file"])


def num_examples(manifest: dict) -> int:
    layout = manifest["layout"]
    return layout["num_steps"] * layout["examples_per_step"]


def _flatten(obj, prefix=""):
    if isinstance(obj, dict):
        out = {}
        for key, value in obj.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: obj}


def diff_manifests(existing: dict, wanted: dict) -> list[str]:
    """Each fingerprinted field that differs, as 'field: store has X, this run has Y'."""
    a = _flatten({key: existing.get(key) for key in FINGERPRINTED})
    b = _flatten({key: wanted.get(key) for key in FINGERPRINTED})
    lines = []
    for key in sorted(set(a) | set(b)):
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            lines.append(f"{key}: store has {a.get(key, '<absent>')!r}, this run has {b.get(key, '<absent>')!r}")
    return lines


def require_same_config(existing: dict, wanted: dict, where: str) -> None:
    """Raise ConfigMismatchError listing every differing field, or return if they match."""
    lines = diff_manifests(existing, wanted)
    if lines:
        raise ConfigMismatchError(
            f"{where} holds a store of another configuration; nothing was changed.\n  "
            + "\n  ".join(lines)
            + "\nUse another --output, or the settings the store was written with."
        )
