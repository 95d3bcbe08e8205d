"""Remote folders (``gs://``): which paths may be remote, and a bucket's pre-flight check.

Only checkpoints go to a bucket (``--checkpoint-dir gs://...``: orbax writes the arrays
through tensorstore's GCS driver and the small files through `etils.epath` on gcsfs).
The other folders of a run stay local or on a mounted filesystem (NFS, gcsfuse):
rollouts are memory-mapped and read a few rows at a time at every update, and
``--out-dir`` holds a lock file and an append-only log, none of which a bucket object
does well (`require_local` says so in one line).

`check_bucket` lists the folder and writes (then deletes) one small probe object, with
no retries, so that an unreachable bucket, a missing one, one the credentials may not
write, or a missing client library is one line before the run loads anything.
The clients find an emulator through ``STORAGE_EMULATOR_HOST`` (gcsfs,
google-cloud-storage) and ``TENSORSTORE_GCS_HTTP_URL`` (tensorstore).
"""

from __future__ import annotations

import os
import socket

GCS = "gs://"
PROBE_TIMEOUT_S = 30
"""Each request of the pre-flight check (seconds); a connection refused fails at once."""


class StorageError(ValueError):
    """A remote folder that cannot be used (unreachable, denied, missing, unsupported)."""


def is_remote(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is a URI (``gs://...``, ``s3://...``) rather than a local path."""
    return path is not None and "://" in os.fspath(path)


def require_local(path: str | os.PathLike | None, name: str, alternative: str) -> None:
    """Refuses a remote ``path`` for the setting ``name`` in one line naming
    ``alternative``; local paths and None pass."""
    if is_remote(path):
        raise StorageError(f"{name} must be a local or mounted folder, got {path}: "
                           f"{alternative}")


def split_gcs(path: str) -> tuple[str, str]:
    """(bucket, prefix without slashes at its ends) of ``gs://bucket/prefix``."""
    bucket, _, prefix = path[len(GCS):].partition("/")
    return bucket, prefix.strip("/")


def check_bucket(directory: str | os.PathLike, name: str = "checkpoint_dir") -> None:
    """Checks that the remote folder ``directory`` can be listed and written.

    Lists one object under it and writes and deletes
    ``<directory>/.tev-train-probe-<host>-<pid>``, without retries.

    Raises:
      StorageError: not a ``gs://`` URI, the gcs client libraries are missing, no
        credentials, the bucket is unreachable, does not exist or denies the access;
        one line naming ``name``, the bucket and the cause.
    """
    text = os.fspath(directory)
    if not text.startswith(GCS):
        raise StorageError(f"{name}={text}: only gs:// buckets are supported as remote "
                           "folders (or a local / mounted folder)")
    try:
        import gcsfs  # noqa: F401  (etils.epath's gs:// backend)
        from google.cloud import storage
    except ImportError:
        raise StorageError(f"{name}={text}: a gs:// folder needs gcsfs and "
                           "google-cloud-storage: pip install 'tev-jax[gcs]'") from None
    bucket, prefix = split_gcs(text)
    if not bucket:
        raise StorageError(f"{name}={text}: no bucket name")
    probe = "/".join(p for p in (prefix, f".tev-train-probe-{socket.gethostname()}-"
                                           f"{os.getpid()}") if p)
    try:
        client = storage.Client()
        blobs = client.list_blobs(bucket, prefix=prefix + "/" if prefix else None,
                                  max_results=1, timeout=PROBE_TIMEOUT_S, retry=None)
        list(blobs)
        blob = client.bucket(bucket).blob(probe)
        blob.upload_from_string(b"", timeout=PROBE_TIMEOUT_S, retry=None)
        blob.delete(timeout=PROBE_TIMEOUT_S, retry=None)
    except Exception as e:  # google.auth, google.api_core and requests raise many types
        raise StorageError(f"{name}={text}: the bucket gs://{bucket} {_cause(e)}; nothing "
                           "was written (check the bucket's name, the credentials and "
                           "their storage.objects list / create / delete permissions)"
                           ) from e


def _cause(e: Exception) -> str:
    """What went wrong, in a few words, from a client library's exception."""
    code = getattr(e, "code", None)
    message = " ".join(str(getattr(e, "message", "") or e).split())
    if message.split(" ", 1)[0] in ("GET", "POST", "PUT", "PATCH", "DELETE"):
        message = message.split(": ", 1)[-1]   # drop "GET <url>: "
    message = message[:200]
    kind = type(e).__name__
    if code in (401, 403):
        return f"denies access (HTTP {code}: {message})"
    if code == 404:
        return f"does not exist (HTTP 404: {message})"
    if "Credentials" in kind or "RefreshError" in kind:
        return ("cannot be reached without Google Cloud credentials (gcloud auth "
                f"application-default login, or a VM's service account; {kind})")
    if "Connection" in kind or "Timeout" in kind:
        return f"is unreachable ({kind})"
    return f"cannot be used ({kind}: {message})"


__all__ = ["GCS", "StorageError", "check_bucket", "is_remote", "require_local", "split_gcs"]
