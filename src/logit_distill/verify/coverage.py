"""The manifest and coverage checks: the store's manifest, and committed chunks covering every step."""

from __future__ import annotations

from .. import paths
from ..errors import StoreError
from ..store import chunks as chunks_mod
from ..store import manifest as manifest_mod
from .report import _Check


def _check_manifest(uri: str, chk: _Check) -> dict | None:
    manifest_uri = paths.join(uri, manifest_mod.MANIFEST_NAME)
    try:
        if not paths.exists(manifest_uri):
            what = "does not exist" if not paths.exists(uri) else f"has no {manifest_mod.MANIFEST_NAME}"
            chk.add("missing", f"{uri} is not a logit store: it {what}", file=manifest_uri)
            return None
        manifest = manifest_mod.parse_manifest(paths.read_bytes(manifest_uri), manifest_uri)
    except StoreError as e:
        chk.add("invalid", str(e), file=manifest_uri)
        return None
    except Exception as e:  # noqa: BLE001 - unreachable bucket, permissions
        chk.add("unreadable", f"{manifest_uri}: cannot be read ({type(e).__name__}: {e})", file=manifest_uri)
        return None
    content = manifest.get("content") or {}
    data = content.get("data") if isinstance(content, dict) else None
    if isinstance(data, dict) and data.get("seq_len") not in (None, manifest["shapes"]["seq_len"]):
        chk.add("inconsistent", f"{manifest_uri}: content.data.seq_len {data.get('seq_len')} differs from "
                                f"shapes.seq_len {manifest['shapes']['seq_len']}", file=manifest_uri)
    dtype = content.get("teacher_dtype") if isinstance(content, dict) else None
    if dtype not in (None, "float32", "bfloat16"):
        chk.add("inconsistent", f"{manifest_uri}: unknown content.teacher_dtype {dtype!r}", file=manifest_uri)
    layout, shapes = manifest["layout"], manifest["shapes"]
    chk.details = {
        "format_version": manifest["format_version"], "fingerprint": manifest["fingerprint"],
        "dump_key": manifest_mod.dump_key(manifest), "shapes": shapes, "layout": layout,
        "codec": manifest["codec"]["name"],
    }
    chk.ok_message = (f"format version {manifest['format_version']}, fingerprint {manifest_mod.dump_key(manifest)}, "
                      f"{layout['num_steps']} steps x {layout['examples_per_step']} examples, seq_len "
                      f"{shapes['seq_len']}, top_k {shapes['top_k']}, codec {manifest['codec']['name']}")
    return manifest


def _check_coverage(uri: str, manifest: dict, scan: chunks_mod.ScanResult, expected_steps: int | None,
                    chk: _Check) -> None:
    layout = manifest["layout"]
    n = layout["num_steps"]
    if expected_steps is not None and int(expected_steps) != n:
        chk.add("expected_steps", f"{uri}: the manifest says {n} steps, --expected-steps says {expected_steps}",
                file=manifest_mod.MANIFEST_NAME)
    for process, ranges in sorted(scan.missing.items()):
        for start, end in ranges:
            chk.add("missing", f"{uri}: missing steps [{start}, {end}) of process {process}: no committed chunk "
                               f"covers them (a gap: re-run the dump to fill it)", process=process, steps=[start, end])
    for group in scan.duplicates:
        names = ", ".join(c.name for c in group)
        c = group[0]
        chk.add("duplicate", f"{uri}: several committed chunks for process {c.process} steps [{c.start}, {c.end}): "
                             f"{names}; delete the wrong one", process=c.process, steps=[c.start, c.end],
                files=[c.name for c in group])
    tag = manifest["fingerprint"][:8]
    valid = set(chunks_mod.expected_ranges(manifest))
    for c in scan.foreign:
        if c.tag != tag:
            why = f"its tag {c.tag} is not this store's {tag}: a chunk of another store configuration"
        elif c.process >= layout["num_processes"]:
            why = f"process {c.process} is outside the store's {layout['num_processes']} processes"
        elif (c.start, c.end) not in valid:
            why = f"steps [{c.start}, {c.end}) are not a chunk range of this layout (steps_per_file " \
                  f"{layout['steps_per_file']}, num_steps {n})"
        else:
            why = "unexpected"
        chk.add("foreign", f"{paths.join(uri, c.name)}: foreign chunk: {why}", chunk=c.name)
    chk.details = {
        "num_steps": n, "num_processes": layout["num_processes"], "chunks_expected": scan.num_expected,
        "chunks_present": scan.num_present,
        "missing": {str(p): [list(r) for r in rs] for p, rs in scan.missing.items() if rs},
        "duplicates": [[c.name for c in g] for g in scan.duplicates],
        "foreign": [c.name for c in scan.foreign],
        "leftovers": list(scan.leftovers),
    }
    chk.ok_message = f"{scan.num_present} of {scan.num_expected} chunks cover steps 0..{n - 1} of " \
                     f"{layout['num_processes']} process{'es' if layout['num_processes'] > 1 else ''}"
    if scan.leftovers:
        chk.ok_message += f"; {len(scan.leftovers)} leftover file(s) not part of the store: " + \
            ", ".join(scan.leftovers[:5]) + (" ..." if len(scan.leftovers) > 5 else "")
