"""HF-format checkpoints: load (local or gs://), build, save, fingerprint."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .. import paths
from ..errors import InputError
from . import decoder, safetensors_io, sources
from .config import DecoderConfig, family_of, from_hf_config

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
_EDGE = 2**20  # bytes hashed at each end of a safetensors file


@dataclasses.dataclass
class LoadedModel:
    family: str
    hf_config: dict
    vocab_size: int
    max_seq_len: int
    dtype: str
    params: Any
    apply: Callable  # apply(params, tokens, positions, segment_ids) -> float32 [B, L, V]
    identity: dict
    tokenizer_path: str | None
    source: str
    config: DecoderConfig | None = None


def _np_dtype(dtype) -> np.dtype:
    name = str(jnp.dtype(dtype)) if not isinstance(dtype, str) else dtype
    if name not in DTYPES:
        raise InputError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _dtype_name(dtype) -> str:
    return str(_np_dtype(dtype))


def build_model(
    hf_config: dict,
    params,
    *,
    dtype: str = "float32",
    identity: dict | None = None,
    tokenizer_path: str | None = None,
    source: str = "",
) -> LoadedModel:
    """A LoadedModel around ``params`` (e.g. from ``init_params``) for ``hf_config``."""
    cfg = from_hf_config(hf_config)
    return LoadedModel(
        family=cfg.family,
        hf_config=dict(hf_config),
        vocab_size=cfg.vocab_size,
        max_seq_len=cfg.max_position_embeddings,
        dtype=_dtype_name(dtype),
        params=params,
        apply=functools.partial(decoder.apply, cfg),
        identity=identity if identity is not None else {"kind": "in-memory"},
        tokenizer_path=tokenizer_path,
        source=source,
        config=cfg,
    )


def init_params(hf_config: dict, seed: int, dtype="float32"):
    """Random parameters (deterministic in ``seed``) for ``hf_config``."""
    cfg = from_hf_config(hf_config)
    init_range = float(hf_config.get("initializer_range", 0.02))
    return decoder.unflatten(cfg, decoder.init_flat(cfg, seed, _np_dtype(dtype), init_range))


# ----------------------------------------------------------------------------- reading


def _safetensors_files(uri: str) -> list[str]:
    index = paths.join(uri, "model.safetensors.index.json")
    if paths.exists(index):
        try:
            weight_map = json.loads(paths.read_bytes(index))["weight_map"]
        except (ValueError, KeyError) as e:
            raise InputError(f"{index}: malformed index ({e})") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not paths.exists(paths.join(uri, f))]
        if missing:
            raise InputError(f"{uri}: safetensors shards named in the index are missing: {', '.join(missing)}")
        return files
    fs, path = paths.url_to_fs(uri)
    files = sorted(
        os.path.basename(p.rstrip("/")) for p in fs.ls(path, detail=False) if p.endswith(".safetensors")
    )
    if not files:
        raise InputError(f"{uri}: no *.safetensors weights (and no model.safetensors.index.json)")
    return files


def checkpoint_identity(uri: str, files: list[str] | None = None) -> dict:
    """Cheap, stable fingerprint: config.json sha256, safetensors names + sizes and
    a sha256 of the first and last MiB of each (no full read of a large file)."""
    files = files if files is not None else _safetensors_files(uri)
    config_sha = hashlib.sha256(paths.read_bytes(paths.join(uri, "config.json"))).hexdigest()
    fs, _ = paths.url_to_fs(uri)
    entries = []
    for name in files:
        _, p = paths.url_to_fs(paths.join(uri, name))
        size = int(fs.size(p))
        h = hashlib.sha256()
        with fs.open(p, "rb") as f:
            h.update(f.read(_EDGE))
            if size > _EDGE:
                f.seek(max(_EDGE, size - _EDGE))
                h.update(f.read(_EDGE))
        entries.append({"name": name, "size": size, "edges_sha256": h.hexdigest()})
    body = {"config_sha256": config_sha, "safetensors": entries}
    fp = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    return {"kind": "checkpoint", **body, "fingerprint": fp}


def local_tokenizer(uri: str) -> str | None:
    tok = paths.join(uri, "tokenizer.json")
    if not paths.exists(tok):
        return None
    if paths.is_local(tok):
        return os.path.abspath(paths.local_path(tok))
    key = hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:16]
    cache = paths.default_cache_dir("tokenizers", key)
    for extra in ("tokenizer_config.json", "special_tokens_map.json"):
        if paths.exists(paths.join(uri, extra)):
            paths.fetch_to_local(paths.join(uri, extra), cache)
    return paths.fetch_to_local(tok, cache)


def _read_placed(reader, name: str, source, dtype: np.dtype, mesh, shard_mode):
    """One parameter onto the mesh, each device's shard read by byte range (rows of dimension 0, dequantized
    or stacked by its ``source``), each distinct row range once per process; host memory holds at most
    this one parameter's bytes."""
    if mesh is None:
        return jnp.asarray(source.rows(reader).astype(dtype, copy=False))
    from .sharding import sharding_for

    shape = tuple(source.shape)
    sharding = sharding_for(shape, mesh, shard_mode, name=name)
    rows: dict = {}

    def shard(index):
        if not shape:
            key = None
            if key not in rows:
                rows[key] = source.rows(reader).astype(dtype, copy=False)
            return rows[key]
        r = index[0].indices(shape[0])[:2]
        if r not in rows:
            rows[r] = source.rows(reader, *r).astype(dtype, copy=False)
        return rows[r][(slice(None), *index[1:])]

    return jax.make_array_from_callback(shape, sharding, shard)


def read_hf_config(uri: str) -> dict:
    """config.json of a checkpoint; InputError if missing, malformed or of an unsupported family."""
    hf_config = paths.read_json(paths.join(uri, "config.json"), "is this an HF checkpoint directory?")
    family_of(hf_config)  # unsupported architecture -> InputError before anything else
    return hf_config


def load_checkpoint(
    uri: str, *, dtype: str = "float32", mesh=None, shard_mode: str = "fsdp"
) -> LoadedModel:
    """Load an HF checkpoint directory (local path or fsspec URI such as gs://)."""
    uri = uri.rstrip("/")
    np_dtype = _np_dtype(dtype)
    hf_config = read_hf_config(uri)
    cfg = from_hf_config(hf_config)
    if mesh is not None and shard_mode in ("expert", "fsdp+expert") and cfg.moe is None:
        raise InputError(f"--sharding {shard_mode} splits a mixture's experts, and {uri} ({cfg.family}) has none; "
                         "use --sharding fsdp, tensor or fsdp+tensor")
    files = _safetensors_files(uri)
    expected = decoder.expected_tensors(cfg)

    # names and shapes first (headers only), so a wrong checkpoint fails before any big read
    found: dict[str, tuple[str, dict]] = {}
    for name in files:
        for t, info in safetensors_io.tensor_names(paths.join(uri, name)).items():
            found[t] = (name, info)
    plan = sources.plan(cfg, hf_config, uri, found, expected)
    reader = sources.Reader(uri, found)
    # in the order of the files' bytes (one pass over each file for checkpoints laid out by layer)
    order = sorted(plan, key=lambda n: (found[plan[n].reads()[0]][0], found[plan[n].reads()[0]][1]["data_offsets"][0]))
    flat = {}
    try:
        for t in order:
            flat[t] = _read_placed(reader, t, plan[t], decoder.tensor_dtype(cfg, t, np_dtype), mesh, shard_mode)
    finally:
        reader.close()
    params = decoder.unflatten(cfg, flat)
    return build_model(
        hf_config,
        params,
        dtype=str(np_dtype),
        identity=checkpoint_identity(uri, files),
        tokenizer_path=local_tokenizer(uri),
        source=uri,
    )


# ----------------------------------------------------------------------------- saving


def save_hf_checkpoint(
    loaded: LoadedModel, params, out_dir: str, tokenizer_path: str | None = None
) -> str:
    """Write ``config.json`` + ``model.safetensors`` (+ tokenizer files) to ``out_dir``
    (local or gs://) so that ``transformers.AutoModelForCausalLM.from_pretrained`` loads it.

    The weights keep ``params``' dtype; with tied embeddings no ``lm_head`` is written.
    Returns ``out_dir``.
    """
    cfg = loaded.config or from_hf_config(loaded.hf_config)
    flat = decoder.flatten(params)
    expected = decoder.expected_tensors(cfg)
    missing = sorted(set(expected) - set(flat))
    if missing:
        raise InputError(f"params lack tensors: {', '.join(missing[:20])}")
    host = sources.checkpoint_tensors(cfg, {name: np.asarray(jax.device_get(flat[name])) for name in expected})
    dtypes = {str(a.dtype) for a in host.values()}
    hf_config = dict(loaded.hf_config)
    hf_config.pop("quantization_config", None)  # the weights written are the dequantized ones
    if len(dtypes) == 1:
        hf_config["dtype"] = dtypes.pop()
        hf_config.pop("torch_dtype", None)
    tok = tokenizer_path or loaded.tokenizer_path
    out_dir = out_dir.rstrip("/")
    tmp = tempfile.mkdtemp(prefix="logit-distill-save-")
    try:
        safetensors_io.write_file(os.path.join(tmp, "model.safetensors"), host)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2, sort_keys=True)
        names = ["model.safetensors", "config.json"]
        if tok:
            local_tok = paths.fetch_to_local(tok, os.path.join(tmp, "fetched"))
            shutil.copyfile(local_tok, os.path.join(tmp, "tokenizer.json"))
            names.append("tokenizer.json")
            side = os.path.join(os.path.dirname(local_tok), "tokenizer_config.json")
            if os.path.exists(side):
                shutil.copyfile(side, os.path.join(tmp, "tokenizer_config.json"))
                names.append("tokenizer_config.json")
        paths.makedirs(out_dir)
        # weights first, config.json last: a directory with a config.json is complete
        for name in sorted(names, key=lambda n: n == "config.json"):
            paths.commit_file(os.path.join(tmp, name), paths.join(out_dir, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
