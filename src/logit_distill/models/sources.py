"""Where each parameter comes from in a checkpoint, and how any row range of it is read.

The parameters are keyed by HF tensor names (``decoder.expected_tensors``); a
checkpoint may hold a parameter

- as is (the dense families, gpt-oss's fused bf16 experts, a checkpoint that
  transformers 5 saved with fused experts): ``Direct``;
- in FP8 with a ``*_scale_inv`` sibling of 128 x 128 block scales (DeepSeek-V3,
  Kimi K2): ``Fp8``, dequantized;
- in MXFP4 as ``NAME_blocks`` / ``NAME_scales`` (gpt-oss's published
  experts): ``Mxfp4``, dequantized and transposed to the bf16 layout;
- one tensor per expert (``mlp.experts.{e}.gate_proj.weight``, ``up_proj``,
  ``down_proj``: Qwen3-MoE, DeepSeek-V3, GLM-4.5 as published, and as
  transformers 5 saves them): ``Stacked``, the experts' tensors (each of them
  ``Direct`` or ``Fp8``) stacked into transformers 5's ``gate_up_proj``
  [E, 2I, D] and ``down_proj`` [E, D, I].

Every source reads rows ``[start, end)`` of its parameter's first dimension
(for stacked experts: a range of experts) by byte range, so a device's shard
costs the bytes of its rows and the host holds at most one parameter.
``checkpoint_tensors`` (the inverse, for saving) writes the published layout.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from .. import paths
from ..errors import InputError
from . import quantized, safetensors_io
from .config import DecoderConfig

# tensors some published checkpoints carry that the forward pass does not use
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class Reader:
    """Byte-range reads of checkpoint tensors across the files of a checkpoint; files opened once."""

    def __init__(self, uri: str, found: dict[str, tuple[str, dict]]):
        self.uri = uri
        self.found = found  # tensor -> (file name, header entry)
        self._open: dict[str, tuple] = {}

    def info(self, tensor: str) -> dict:
        return self.found[tensor][1]

    def shape(self, tensor: str) -> tuple:
        return tuple(self.found[tensor][1]["shape"])

    def rows(self, tensor: str, start: int | None = None, end: int | None = None) -> np.ndarray:
        name, info = self.found[tensor]
        if name not in self._open:
            file_uri = paths.join(self.uri, name)
            fs, path = paths.url_to_fs(file_uri)
            # local files unbuffered (each read goes straight into its buffer), others through fsspec
            f = open(paths.local_path(file_uri), "rb", buffering=0) if paths.is_local(file_uri) else fs.open(path, "rb")
            _, base = safetensors_io.read_header(f, file_uri)
            self._open[name] = (f, file_uri, base)
        f, file_uri, base = self._open[name]
        return safetensors_io.read_rows(f, file_uri, base, tensor, info, start, end)

    def close(self) -> None:
        for f, _, _ in self._open.values():
            f.close()
        self._open.clear()


@dataclasses.dataclass
class Direct:
    tensor: str
    shape: tuple

    def rows(self, reader: Reader, start=None, end=None) -> np.ndarray:
        return reader.rows(self.tensor, start, end)

    def reads(self) -> list[str]:
        return [self.tensor]


@dataclasses.dataclass
class Fp8:
    tensor: str
    scale: str
    shape: tuple
    block: tuple

    def rows(self, reader: Reader, start=None, end=None) -> np.ndarray:
        weight = reader.rows(self.tensor, start, end)
        lead = self.shape[:-2]
        if lead:  # fused [E, out, in]: each expert its own scale grid
            scales = reader.rows(self.scale, start, end)
            return np.stack([quantized.dequantize_fp8(w, s, self.block) for w, s in zip(weight, scales)])
        scales = reader.rows(self.scale)
        return quantized.dequantize_fp8(weight, scales, self.block, row_start=start or 0, total_rows=self.shape[0])

    def reads(self) -> list[str]:
        return [self.tensor, self.scale]


@dataclasses.dataclass
class Mxfp4:
    blocks: str
    scales: str
    shape: tuple  # the bf16 layout [E, in, out]

    def rows(self, reader: Reader, start=None, end=None) -> np.ndarray:
        values = quantized.dequantize_mxfp4(reader.rows(self.blocks, start, end), reader.rows(self.scales, start, end))
        return np.swapaxes(values, -1, -2)  # [E, out, in] -> [E, in, out]

    def reads(self) -> list[str]:
        return [self.blocks, self.scales]


@dataclasses.dataclass
class Stacked:
    """Experts first: parameter row e is the concatenation (along its first dim) of ``parts[e]``."""

    parts: list  # per expert: the sources concatenated
    shape: tuple

    def rows(self, reader: Reader, start=None, end=None) -> np.ndarray:
        start = 0 if start is None else start
        end = self.shape[0] if end is None else end
        return np.stack([np.concatenate([p.rows(reader) for p in self.parts[e]], axis=0)
                         for e in range(start, end)])

    def reads(self) -> list[str]:
        return [t for parts in self.parts for p in parts for t in p.reads()]


def _scale_name(tensor: str) -> str:
    return tensor[: -len(".weight")] + ".weight_scale_inv" if tensor.endswith(".weight") else tensor + "_scale_inv"


def _fp8_block(hf_config: dict) -> tuple:
    q = hf_config.get("quantization_config") or {}
    return tuple(q.get("weight_block_size") or quantized.DEFAULT_FP8_BLOCK)


def check_quantization(hf_config: dict, uri: str) -> None:
    q = hf_config.get("quantization_config")
    if q and q.get("quant_method") not in ("fp8", "mxfp4"):
        raise InputError(f"{uri}: quantization_config quant_method {q.get('quant_method')!r} is not supported; "
                         "supported: fp8 (block scales), mxfp4, or unquantized weights")


def _plain(tensor: str, found, block) -> Direct | Fp8 | None:
    if tensor not in found:
        return None
    shape = tuple(found[tensor][1]["shape"])
    scale = _scale_name(tensor)
    if scale in found and found[tensor][1]["dtype"].startswith("F8"):
        return Fp8(tensor, scale, shape, block)
    return Direct(tensor, shape)


_PER_EXPERT = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _source(cfg: DecoderConfig, name: str, shape: tuple, found, block):
    src = _plain(name, found, block)
    if src is not None:
        return src
    prefix, _, proj = name.rpartition(".")
    if name + "_blocks" in found and name + "_scales" in found and prefix.endswith("mlp.experts"):
        return Mxfp4(name + "_blocks", name + "_scales", shape)  # gpt-oss's experts: [E, in, out] once dequantized
    if prefix.endswith("mlp.experts") and proj in _PER_EXPERT and cfg.moe is not None \
            and cfg.moe.layout == "concatenated":
        parts = []
        for e in range(shape[0]):
            srcs = [_plain(f"{prefix}.{e}.{p}.weight", found, block) for p in _PER_EXPERT[proj]]
            if any(s is None for s in srcs):
                return None
            parts.append(srcs)
        return Stacked(parts, shape)
    return None


def _tolerated(cfg: DecoderConfig, tensor: str) -> bool:
    if tensor.endswith(IGNORED_SUFFIXES) or (tensor == "lm_head.weight" and cfg.tie_embeddings):
        return True
    # DeepSeek-V3 / GLM-4.5 publish their multi-token-prediction layers after the last layer; transformers
    # ignores them (``_keys_to_ignore_on_load_unexpected``), so do we
    m = _LAYER.match(tensor)
    return bool(m) and int(m.group(1)) >= cfg.num_layers and cfg.family in ("deepseek_v3", "glm4_moe")


def _shape_of(src) -> tuple:
    if isinstance(src, Stacked):
        first = [p.shape for p in src.parts[0]]
        return (len(src.parts), sum(s[0] for s in first), *first[0][1:])
    return tuple(src.shape)


def plan(cfg: DecoderConfig, hf_config: dict, uri: str, found: dict, expected: dict) -> dict:
    """{parameter name: source} for a checkpoint whose tensors are ``found`` ({name: (file, header
    entry)}); an InputError naming what is missing, unexpected or misshapen."""
    check_quantization(hf_config, uri)
    block = _fp8_block(hf_config)
    sources, missing = {}, []
    for name, shape in expected.items():
        src = _source(cfg, name, tuple(shape), found, block)
        if src is None:
            missing.append(name)
        else:
            sources[name] = src
    used = {t for s in sources.values() for t in s.reads()}
    extra = sorted(t for t in found if t not in used and not _tolerated(cfg, t))
    if missing or extra:
        msg = [f"{uri}: tensors do not match a {cfg.family} model of this config.json"]
        if missing:
            msg.append(f"missing ({len(missing)}): {', '.join(missing[:20])}" + (" ..." if len(missing) > 20 else ""))
        if extra:
            msg.append(f"unexpected ({len(extra)}): {', '.join(extra[:20])}" + (" ..." if len(extra) > 20 else ""))
        raise InputError("; ".join(msg))
    bad = []
    for name, src in sources.items():
        got = _shape_of(src)
        if isinstance(src, Stacked):
            ref = [tuple(p.shape) for p in src.parts[0]]
            if any([tuple(p.shape) for p in parts] != ref for parts in src.parts):
                bad.append(f"{name}: the experts' tensors differ in shape")
        if got != tuple(expected[name]):
            bad.append(f"{name} {list(got)} != {list(expected[name])}")
    if bad:
        raise InputError(f"{uri}: tensor shapes do not match config.json: {'; '.join(bad[:10])}")
    for src in sources.values():  # quantized tensors: their dtype and the scales' shape, before any read
        for t in src.reads():
            dtype = found[t][1]["dtype"]
            if dtype not in safetensors_io.DTYPES:
                raise InputError(f"{uri}: tensor {t} has unsupported dtype {dtype}")
    return sources


def checkpoint_tensors(cfg: DecoderConfig, flat: dict) -> dict:
    """Parameters -> the tensors a checkpoint holds, in the published layout: one tensor per expert for
    the concatenated (transformers 5) experts, as transformers 5's ``save_pretrained`` writes them."""
    out = {}
    for name, a in flat.items():
        prefix, _, proj = name.rpartition(".")
        if prefix.endswith("mlp.experts") and proj in _PER_EXPERT and cfg.moe is not None \
                and cfg.moe.layout == "concatenated":
            a = np.asarray(a)
            parts = _PER_EXPERT[proj]
            for e in range(a.shape[0]):
                for p, piece in zip(parts, np.split(a[e], len(parts), axis=0)):
                    out[f"{prefix}.{e}.{p}.weight"] = piece
        else:
            out[name] = a
    return out
