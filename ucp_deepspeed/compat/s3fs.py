"""The reach into s3fs: a ranged GET received straight into the caller's buffers.

s3fs's `cat_file` joins a response into one `bytes`, a copy of every byte into fresh memory that the caller then
copies again into its own buffer; on a rank that fetches its whole share of a checkpoint, that copy competes with
the transfer for the CPU. `s3_read_into` sends the request through s3fs's own request path (`_call_s3`: the
filesystem's request options, such as SSE-C keys and requester pays, apply, and boto's errors become s3fs's) and
receives the body with aiobotocore's `StreamingBody.readinto`.
"""

from __future__ import annotations

from typing import Any


def s3_read_into(fs: Any, path: str, start: int, views: list[memoryview]) -> int:
    """Receive bytes [start, start + total of `views`) of an S3 object into `views`, in order; returns how many
    arrived (fewer only where the object ends sooner).

    Args:
        fs: an `s3fs.S3FileSystem`.
        path: the object, as s3fs names it (`bucket/key`, no scheme).
        start: the first byte.
        views: writable buffers, filled one after another.

    Returns:
        The bytes received.
    """
    from fsspec.asyn import sync

    total = sum(len(v) for v in views)
    if total == 0:
        return 0
    bucket, key, version = fs.split_path(path)
    extra = {"VersionId": version} if version else {}

    async def get() -> int:
        response = await fs._call_s3(
            "get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{start + total - 1}", **extra
        )
        body = response["Body"]
        got = 0
        try:
            for view in views:
                filled = 0
                while filled < len(view):
                    n = await body.readinto(view[filled:])
                    if not n:
                        return got + filled
                    filled += n
                got += filled
            return got
        finally:
            body.close()

    received: int = sync(fs.loop, get)
    return received
