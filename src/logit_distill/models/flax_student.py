"""Students written as Flax NNX modules: ``flax:MODULE:FACTORY[?key=value&...]``.

- ``parse_spec(spec)``: the spec string -> ``FlaxSpec(module, factory, kwargs)``; values are JSON
  literals where they parse (``4``, ``0.5``, ``true``, ``"x"``), else strings.
- ``build(spec, vocab_size=V, seq_len=L)``: import the module, check the factory with one abstract
  call (``nnx.eval_shape``, no weights allocated): it returns an ``nnx.Module`` whose
  ``__call__(tokens, positions, segment_ids)`` gives logits ``[B, L, V]``; then build it for real
  and split it into ``FlaxStudent`` (graphdef, trainable ``nnx.Param`` values as a flat
  ``{"a.b.0.kernel": array}`` dict, the other variables as constants).
- ``save_student(student, params, out_dir)`` / ``load_student(dir)``: the trained ``nnx.Param``
  values as ``model.safetensors`` (the flat names) + ``student.json`` (the spec, the factory and its
  arguments); ``load_student`` calls the factory again and puts the weights back.
- ``TokensAndMask``: wraps a module that takes ``(tokens, mask)`` into the protocol.

Only ``nnx.Param`` variables are trained and exported; other variables (RNG counters, buffers)
stay as the factory made them. Annotations from ``nnx.with_partitioning`` are read with
``nnx.get_partition_spec``; modules are constructed with eager sharding off, and
``partition_specs`` maps their axis names onto the training mesh. See docs/STUDENTS.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import shutil
import tempfile
import urllib.parse
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .. import paths
from ..errors import InputError
from . import safetensors_io, specs

PREFIX = specs.FLAX
META_NAME = "student.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT = "logit-distill-flax-nnx-student"
# annotation axis names that mean "split over the data-parallel (fsdp) axis"
FSDP_NAMES = ("fsdp", "data")


@dataclasses.dataclass(frozen=True)
class FlaxSpec:
    spec: str
    module: str
    factory: str
    kwargs: dict

    @property
    def target(self) -> str:
        return f"{self.module}:{self.factory}"


def _value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_spec(spec: str) -> FlaxSpec:
    """``flax:MODULE:FACTORY[?key=value&...]`` -> FlaxSpec; InputError naming the spec if malformed."""
    body = spec[len(PREFIX):] if spec.startswith(PREFIX) else spec
    target, sep, query = body.partition("?")
    module, colon, factory = target.partition(":")
    usage = "write flax:MODULE:FACTORY[?key=value&...], e.g. flax:examples.students.tiny_transformer:make?num_layers=3"
    if not colon or not module or not factory or ":" in factory:
        raise InputError(f"student {spec!r}: expected MODULE:FACTORY after 'flax:'; {usage}")
    if not all(part.isidentifier() for part in module.split(".")) or not factory.isidentifier():
        raise InputError(f"student {spec!r}: {target!r} is not a dotted module path and a function name; {usage}")
    kwargs: dict[str, Any] = {}
    if sep:
        for pair in query.split("&"):
            key, eq, raw = pair.partition("=")
            key = urllib.parse.unquote(key)
            if not eq or not key.isidentifier():
                raise InputError(f"student {spec!r}: {pair!r} is not key=value (key a Python identifier); {usage}")
            if key in kwargs:
                raise InputError(f"student {spec!r}: {key!r} is given twice")
            if key == "vocab_size":
                raise InputError(f"student {spec!r}: vocab_size comes from the store (the teacher's vocabulary); "
                                 "remove it from the spec")
            kwargs[key] = _value(urllib.parse.unquote(raw))
    return FlaxSpec(spec=spec, module=module, factory=factory, kwargs=kwargs)


def _factory(fs: FlaxSpec):
    try:
        mod = importlib.import_module(fs.module)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - any failure while importing user code is bad input
        what = f"it called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"{type(e).__name__}: {e}"
        raise InputError(f"student {fs.spec!r}: cannot import module {fs.module!r} ({_first_line_of(what)}); "
                         "the module must be importable (on PYTHONPATH) without side effects") from None
    fn = getattr(mod, fs.factory, None)
    if fn is None or not callable(fn):
        raise InputError(f"student {fs.spec!r}: module {fs.module!r} has no callable {fs.factory!r}")
    return fn


def _construct(fs: FlaxSpec, fn, vocab_size: int, *, abstract: bool):
    """``fn(vocab_size=..., **kwargs)`` (abstractly with ``nnx.eval_shape``), checked to be an nnx.Module."""
    got: dict[str, type] = {}

    def make():
        module = fn(vocab_size=int(vocab_size), **fs.kwargs)
        if not isinstance(module, nnx.Module):
            got["type"] = type(module)
            return None
        return module

    try:
        with nnx.use_eager_sharding(False):
            module = nnx.eval_shape(make) if abstract else make()
    except InputError:
        raise
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the factory is user code
        raise InputError(f"student {fs.spec!r}: the factory {fs.target}(vocab_size={vocab_size}, "
                         f"**{fs.kwargs!r}) failed: {type(e).__name__}: {_first_line(e)}") from None
    if "type" in got:
        raise InputError(f"student {fs.spec!r}: the factory {fs.target} returned a {got['type'].__name__}, "
                         "not a flax.nnx.Module")
    return module


def _first_line(e: Exception) -> str:
    return _first_line_of(str(e))


def _first_line_of(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


def _leaf_value(v):
    return v.get_value() if hasattr(v, "get_value") else v.value


def _split(module):
    """(graphdef, {flat name: Param variable}, {flat name: path}, constants state)."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    variables, path_of = {}, {}
    for path, var in nnx.to_flat_state(params):
        name = ".".join(str(p) for p in path)
        if name in path_of:
            raise InputError(f"two parameters flatten to the same name {name!r}")
        variables[name], path_of[name] = var, tuple(path)
    return graphdef, variables, path_of, rest


def make_apply(graphdef, path_of: dict, rest):
    """``apply(params, tokens, positions, segment_ids) -> float32 logits``: the module rebuilt
    from the flat params (``nnx.merge``) and called; pure, jit-able, differentiable in ``params``."""
    def apply(params, tokens, positions, segment_ids):
        state = nnx.from_flat_state({path_of[n]: a for n, a in params.items()})
        module = nnx.merge(graphdef, state, rest)
        return jnp.asarray(module(tokens, positions, segment_ids), jnp.float32)

    return apply


@dataclasses.dataclass
class FlaxStudent:
    spec: FlaxSpec
    vocab_size: int
    params: dict  # {flat name: array}: the nnx.Param values
    apply: Any
    annotations: dict  # {flat name: tuple of axis names or None} from nnx.with_partitioning
    identity: dict
    max_seq_len: int | None = None
    tokenizer_path: str | None = None
    kind: str = "flax"
    graphdef: Any = None
    path_of: dict = dataclasses.field(default_factory=dict)


def _structure_fingerprint(variables: dict) -> str:
    rows = [[n, list(v.shape), str(v.dtype)] for n, v in sorted(variables.items())]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class FlaxDescription:
    """What ``describe`` finds of a Flax student without allocating a weight."""

    spec: FlaxSpec
    vocab_size: int
    identity: dict
    annotations: dict  # {flat name: tuple of axis names or None} from nnx.with_partitioning


def describe(spec: str, *, vocab_size: int, seq_len: int) -> FlaxDescription:
    """The student of ``spec`` for a store of ``vocab_size`` and ``seq_len``, checked with abstract calls
    (``nnx.eval_shape``, no weights allocated); InputError (naming the factory) when it cannot be
    imported, is not an nnx.Module, or gives logits of another shape than ``[B, seq_len, vocab_size]``."""
    fs = parse_spec(spec)
    fn = _factory(fs)
    abstract = _construct(fs, fn, vocab_size, abstract=True)
    graphdef, variables, path_of, rest = _split(abstract)
    if not variables:
        raise InputError(f"student {spec!r}: the module {fs.target} returned has no nnx.Param to train")
    ids = jax.ShapeDtypeStruct((1, int(seq_len)), jnp.int32)
    abstract_params = {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in variables.items()}
    try:
        out = jax.eval_shape(make_apply(graphdef, path_of, rest), abstract_params, ids, ids, ids)
    except Exception as e:  # noqa: BLE001 - the module's __call__ is user code
        raise InputError(f"student {spec!r}: calling the module of {fs.target} on tokens, positions, segment_ids "
                         f"of shape [1, {seq_len}] failed: {type(e).__name__}: {_first_line(e)} "
                         "(the protocol: __call__(tokens, positions, segment_ids) -> logits [B, L, V])") from None
    want = (1, int(seq_len), int(vocab_size))
    if tuple(out.shape) != want:
        what = (f"logits over a vocabulary of {out.shape[-1]}, not the store's {vocab_size}"
                if len(out.shape) == 3 and tuple(out.shape[:2]) == want[:2]
                else f"an array of shape {list(out.shape)}, not logits [1, {seq_len}, {vocab_size}]")
        raise InputError(f"student {spec!r}: the module of {fs.target} returns {what}; "
                         "a student must share the teacher's vocabulary")
    annotations = {}
    for name, var in variables.items():
        axes = var.get_metadata().get("out_sharding") if hasattr(var, "get_metadata") else None
        annotations[name] = tuple(axes) if axes else None
    identity = {"kind": "flax", "factory": fs.target, "kwargs": fs.kwargs, "vocab_size": int(vocab_size),
                "params_sha256": _structure_fingerprint(abstract_params)}
    return FlaxDescription(spec=fs, vocab_size=int(vocab_size), identity=identity, annotations=annotations)


def build(spec: str, *, vocab_size: int, seq_len: int) -> FlaxStudent:
    """The student of ``spec``, checked (``describe``), then initialized for real."""
    described = describe(spec, vocab_size=vocab_size, seq_len=seq_len)
    fs = described.spec
    module = _construct(fs, _factory(fs), vocab_size, abstract=False)  # the real initialization
    graphdef, variables, path_of, rest = _split(module)
    params = {n: jnp.asarray(_leaf_value(v)) for n, v in variables.items()}
    identity = {**described.identity, "params_sha256": _structure_fingerprint(params)}
    return FlaxStudent(spec=fs, vocab_size=int(vocab_size), params=params,
                       apply=make_apply(graphdef, path_of, rest), annotations=described.annotations,
                       identity=identity, graphdef=graphdef, path_of=path_of)


# ----------------------------------------------------------------------------- sharding


def partition_specs(student: FlaxStudent, mesh, mode: str) -> dict:
    """{flat name: PartitionSpec} on ``mesh`` (its data axis, see ``models.sharding.fsdp_axis``).

    ``replicate``: every parameter whole. ``fsdp``: an annotated parameter is split where its
    annotation names ``fsdp`` or ``data`` (other axis names, e.g. ``model``, have no mesh axis here
    and stay whole); an unannotated one follows the built-in rule (largest divisible dimension).
    """
    from jax.sharding import PartitionSpec as P

    from .sharding import fsdp_axis, spec_for

    specs = {}
    axis = fsdp_axis(mesh)
    n = mesh.shape[axis]
    for name, a in student.params.items():
        ann = student.annotations.get(name)
        if mode == "replicate":
            specs[name] = P()
        elif ann is None:
            specs[name] = spec_for(a.shape, mesh, mode)
        else:
            dims, used = [], False
            for dim, axis_name in enumerate(ann):
                names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
                if not used and any(x in FSDP_NAMES for x in names):
                    if a.shape[dim] % n:
                        raise InputError(
                            f"student {student.spec.spec!r}: parameter {name} {list(a.shape)} is annotated to "
                            f"split dimension {dim} over the {n} devices, which do not divide {a.shape[dim]}; "
                            "change the annotation or the device count, or use --param-sharding replicate")
                    dims.append(axis)
                    used = True
                else:
                    dims.append(None)
            specs[name] = P(*dims)
    return specs


def place_state(student: FlaxStudent, state, mesh, mode: str):
    """``state`` ({"params", "opt_state", "step"}) on ``mesh``: each parameter by its spec, each
    optimizer leaf like the parameter of its name (Adam moments), the rest replicated."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from .sharding import auto_mesh

    specs = partition_specs(student, mesh, mode)
    shapes = {n: tuple(a.shape) for n, a in student.params.items()}
    mesh = auto_mesh(mesh)

    def place(path, x):
        key = getattr(path[-1], "key", None) if path else None
        spec = specs[key] if key in specs and tuple(np.shape(x)) == shapes[key] else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(place, state)


# ----------------------------------------------------------------------------- export and load


def save_student(student: FlaxStudent, params: dict, out_dir: str, tokenizer_path: str | None = None) -> str:
    """``model.safetensors`` (the nnx.Param values by flat name) + ``student.json`` (+ tokenizer.json)
    in ``out_dir`` (local or gs://); ``student.json`` is written last. Returns ``out_dir``."""
    host = {n: np.asarray(jax.device_get(a)) for n, a in params.items()}
    meta = {
        "format": FORMAT,
        "student": student.spec.spec,
        "module": student.spec.module,
        "factory": student.spec.factory,
        "kwargs": student.spec.kwargs,
        "vocab_size": student.vocab_size,
        "tensors": {n: {"path": list(student.path_of[n]), "shape": list(a.shape), "dtype": str(a.dtype)}
                    for n, a in sorted(host.items())},
    }
    out_dir = out_dir.rstrip("/")
    tmp = tempfile.mkdtemp(prefix="logit-distill-save-")
    try:
        safetensors_io.write_file(os.path.join(tmp, WEIGHTS_NAME), host, metadata={"format": "flax-nnx"})
        names = [WEIGHTS_NAME]
        if tokenizer_path:
            shutil.copyfile(paths.fetch_to_local(tokenizer_path, os.path.join(tmp, "fetched")),
                            os.path.join(tmp, "tokenizer.json"))
            names.append("tokenizer.json")
            meta["tokenizer"] = "tokenizer.json"
        with open(os.path.join(tmp, META_NAME), "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
        names.append(META_NAME)
        paths.makedirs(out_dir)
        for name in names:  # student.json last: a directory with one is complete
            paths.commit_file(os.path.join(tmp, name), paths.join(out_dir, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def read_meta(directory: str) -> dict:
    uri = paths.join(directory.rstrip("/"), META_NAME)
    meta = paths.read_json(uri, "is this a Flax student exported by logit-distill train?")
    if meta.get("format") != FORMAT:
        raise InputError(f"{uri}: format {meta.get('format')!r} is not {FORMAT!r}")
    return meta


def load_student(directory: str):
    """The ``nnx.Module`` exported to ``directory``: the factory of ``student.json`` called with its
    arguments, its nnx.Param values replaced by ``model.safetensors``. The module must be importable."""
    directory = directory.rstrip("/")
    meta = read_meta(directory)
    fs = parse_spec(meta["student"])
    module = _construct(fs, _factory(fs), int(meta["vocab_size"]), abstract=False)
    _, variables, path_of, _ = _split(module)
    uri = paths.join(directory, WEIGHTS_NAME)
    loaded = dict(safetensors_io.read_tensors(uri))
    missing, extra = sorted(set(variables) - set(loaded)), sorted(set(loaded) - set(variables))
    if missing or extra:
        raise InputError(f"{uri}: tensors do not match the module of {fs.target} (missing: {missing[:10]}, "
                         f"unexpected: {extra[:10]})")
    bad = [f"{n} {list(loaded[n].shape)} != {list(v.shape)}" for n, v in variables.items()
           if tuple(loaded[n].shape) != tuple(v.shape)]
    if bad:
        raise InputError(f"{uri}: tensor shapes do not match the module of {fs.target}: {'; '.join(bad[:10])}")
    nnx.update(module, nnx.from_flat_state({path_of[n]: jnp.asarray(a) for n, a in loaded.items()}))
    return module


# ----------------------------------------------------------------------------- adapter


def causal_segment_mask(segment_ids):
    """``[B, 1, L, L]`` bool: query i sees key j when j <= i, both in the same segment, not padding
    (the mask layout of ``flax.nnx.MultiHeadAttention``)."""
    seg = jnp.asarray(segment_ids)
    L = seg.shape[-1]
    causal = jnp.tril(jnp.ones((L, L), bool))
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
    return (same & causal)[:, None, :, :]


class TokensAndMask(nnx.Module):
    """The student protocol around a module called as ``inner(tokens, mask)``.

    ``mask="attention"`` (default): the ``[B, 1, L, L]`` causal, same-document mask of
    ``causal_segment_mask`` (packed examples stay apart). ``mask="padding"``: ``[B, L]`` bool, true on
    real tokens; with packed data the inner module then sees across document boundaries, so use it
    with stores dumped with ``--no-packing``. Positions are not passed.
    """

    def __init__(self, inner, mask: str = "attention"):
        if mask not in ("attention", "padding"):
            raise InputError(f"TokensAndMask: mask must be 'attention' or 'padding', got {mask!r}")
        self.inner = inner
        self.mask = mask

    def __call__(self, tokens, positions, segment_ids):
        m = causal_segment_mask(segment_ids) if self.mask == "attention" else jnp.asarray(segment_ids) > 0
        return self.inner(tokens, m)
