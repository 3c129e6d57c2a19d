"""A GCS emulator (gcp-storage-emulator) on loopback, for tests, benchmarks and local trials.

gs:// paths reach it through the standard ``STORAGE_EMULATOR_HOST`` variable
(see ``paths``). The emulator is a test dependency (``pip install .[test]``).

gcp-storage-emulator ignores GCS's preconditions; the store's lease needs one
(an object created only if absent). ``python -m logit_distill.emulator PORT``
runs the same emulator with the ``ifGenerationMatch`` precondition of real GCS
on uploads and deletes (HTTP 412 when it does not hold; ``0`` means "no live
object"), and with the object's generation in the headers of a download, as GCS
sends it (tensorstore's OCDBT checkpoints condition writes on it). The emulator serves one request at a time, so check and write are
one step, as on GCS.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from http import HTTPStatus


@contextlib.contextmanager
def gcs_emulator(port: int, timeout_s: float = 30.0):
    """Run an in-memory emulator on 127.0.0.1:``port``; yield its URL; stop it on exit."""
    proc = subprocess.Popen([sys.executable, "-m", "logit_distill.emulator", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"gcp-storage-emulator did not start on port {port}") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------- the ifGenerationMatch precondition

_PRECONDITION_FAILED = {"error": {"code": 412, "message": "At least one of the pre-conditions you specified "
                                  "did not hold.", "errors": [{"message": "Precondition Failed",
                                                               "domain": "global", "reason": "conditionNotMet"}]}}


def _precondition_holds(request, storage, bucket: str, name: str | None) -> bool:
    wanted = request.query.get("ifGenerationMatch")
    if not wanted or name is None:
        return True
    from gcp_storage_emulator.exceptions import NotFound

    try:
        current = str(storage.get_file_obj(bucket, name)["generation"])
    except NotFound:
        current = "0"
    return current == str(wanted[0])


def _with_precondition(handler, name_of):
    def checked(request, response, storage, *args, **kwargs):
        bucket = request.params["bucket_name"]
        if not _precondition_holds(request, storage, bucket, name_of(request)):
            response.status = HTTPStatus.PRECONDITION_FAILED
            response.json(_PRECONDITION_FAILED)
            return None
        return handler(request, response, storage, *args, **kwargs)

    return checked


def _with_generation_headers(download):
    """Media downloads carry ``x-goog-generation``/``x-goog-metageneration`` as on GCS:
    tensorstore (Orbax's OCDBT checkpoints) conditions its next write on the generation it read."""

    def download_with_generation(request, response, storage, *args, **kwargs):
        result = download(request, response, storage, *args, **kwargs)
        if response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
            from gcp_storage_emulator.exceptions import NotFound

            try:
                obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
            except NotFound:
                return result
            response["x-goog-generation"] = str(obj.get("generation", "0"))
            response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))
        return result

    return download_with_generation


def _install_preconditions() -> None:
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    # objects.get() calls download() through the module for ?alt=media; the routes hold it too.
    original_download = objects.download
    objects.download = _with_generation_headers(original_download)

    def upload_name(request):
        if "name" in request.query:
            return request.query["name"][0]
        data = request.data
        if isinstance(data, dict):
            meta = data.get("meta") if isinstance(data.get("meta"), dict) else data
            return meta.get("name")
        return None

    # insert() looks these up at call time; the routes table holds delete() itself.
    for attr in ("_media_upload", "_multipart_upload", "_create_resumable_upload"):
        setattr(objects, attr, _with_precondition(getattr(objects, attr), upload_name))
    checked_delete = _with_precondition(objects.delete, lambda r: r.params.get("object_id"))
    swap = {objects.delete: checked_delete, original_download: objects.download}
    server.HANDLERS = tuple(
        (regex, {method: swap.get(h, h) for method, h in handlers.items()})
        for regex, handlers in server.HANDLERS
    )


def serve(port: int) -> None:
    """Run the emulator (in memory) on 127.0.0.1:``port`` with preconditions, until killed."""
    import logging

    from gcp_storage_emulator.server import Server

    logging.getLogger("gcp_storage_emulator").setLevel(logging.WARNING)
    _install_preconditions()
    Server("127.0.0.1", port, in_memory=True).run()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
