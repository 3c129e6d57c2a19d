"""Dequantizing the published quantized checkpoints, on the host, one shard's rows at a time.

- **MXFP4** (gpt-oss experts): ``NAME_blocks`` uint8 ``[..., G, 16]`` hold two
  4-bit E2M1 values per byte (low nibble first) for blocks of 32 values, and
  ``NAME_scales`` uint8 ``[..., G]`` one power-of-two exponent per block (bias
  127). The value is ``FP4[nibble] * 2**(scale - 127)``, exactly as
  transformers' ``integrations/mxfp4.py`` (``convert_moe_packed_tensors``)
  computes it; blocks run along the input dimension, so the published
  ``[E, out, in/32, 16]`` dequantizes to ``[E, out, in]`` and is transposed to
  the ``[E, in, out]`` of gpt-oss's bf16 tensors.
- **FP8 with block scales** (DeepSeek-V3, Kimi K2): ``NAME.weight`` in
  float8_e4m3fn and ``NAME.weight_scale_inv`` float32 ``[ceil(out/bm),
  ceil(in/bn)]`` (``quantization_config.weight_block_size``, 128 x 128); the
  value is ``weight * scale_inv`` of its block (transformers'
  ``Fp8Dequantize``, DeepSeek's ``weight_dequant``). Dimensions need not be
  multiples of the block (DeepSeek-V3's ``kv_a_proj_with_mqa`` has 576 rows):
  the last block is partial.

Both return float32; the caller casts to the compute dtype (``--dtype``), so
the model computes as transformers' ``dequantize=True`` load does.
"""

from __future__ import annotations

import numpy as np

FP4_VALUES = np.array([+0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
MXFP4_BLOCK = 32  # values per scale
DEFAULT_FP8_BLOCK = (128, 128)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 ``[..., G * 32]`` from uint8 blocks ``[..., G, 16]`` and exponents ``[..., G]``."""
    blocks = np.asarray(blocks).view(np.uint8)
    scales = np.asarray(scales).view(np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape}")
    values = np.empty((*blocks.shape[:-1], MXFP4_BLOCK), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    out = np.ldexp(values, (scales.astype(np.int32) - 127)[..., None])
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * MXFP4_BLOCK)


def dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray, block=DEFAULT_FP8_BLOCK, row_start: int = 0,
                   total_rows: int | None = None) -> np.ndarray:
    """float32 rows ``[row_start, row_start + len(weight))`` of an FP8 weight ``[rows, cols]`` from its
    block scales ``scale_inv`` (all of them, ``[ceil(total_rows / bm), ceil(cols / bn)]``)."""
    bm, bn = int(block[0]), int(block[1])
    rows, cols = weight.shape
    total_rows = row_start + rows if total_rows is None else total_rows
    expected = (-(-total_rows // bm), -(-cols // bn))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"FP8 scales {tuple(scale_inv.shape)} != {expected} for a [{total_rows}, {cols}] weight "
                         f"in blocks of {bm} x {bn}")
    s = np.asarray(scale_inv, np.float32)[(row_start + np.arange(rows)) // bm]  # [rows, col blocks]
    out = weight.astype(np.float32).reshape(rows, -1)
    if cols % bn == 0:
        out = (out.reshape(rows, cols // bn, bn) * s[:, :, None]).reshape(rows, cols)
    else:
        out = out * np.repeat(s, bn, axis=1)[:, :cols]
    return out
