"""The storage layer against a real S3 server (moto's, on 127.0.0.1): ranged reads, whole-object writes, listings,
and every fault with one clear line that names the object or bucket and never a secret."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from s3server import SECRET, S3Server, s3_server

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.paths import is_tag_folder
from ucp_deepspeed.io import remote, stats
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.io.spread import KEYS, SPREAD, Spread
from ucp_deepspeed.io.torch_file import TorchFile, load_file


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server


@pytest.fixture
def bucket(s3: S3Server) -> str:
    return f"s3://{s3.bucket()}"


def test_a_scheme_nothing_serves_is_refused_not_taken_for_a_folder() -> None:
    with pytest.raises(CheckpointError, match=r"nosuch://bucket/run: 'nosuch://' is not a storage scheme"):
        st.normalize("nosuch://bucket/run")
    assert st.normalize("file:///tmp/x") == "/tmp/x"
    assert not st.is_url("s3:/bucket/run")  # one slash: a local path, as POSIX reads it


@pytest.mark.parametrize(
    "url", [f"s3://AKIAEXAMPLE:{SECRET}@bucket/run", f"s3://bucket/run?secret_key={SECRET}", "s3://AKIA@bucket/run"]
)
def test_a_url_with_credentials_is_refused_without_repeating_them(url: str) -> None:
    with pytest.raises(CheckpointError) as caught:
        st.normalize(url)
    assert "carries credentials" in str(caught.value)
    assert SECRET not in str(caught.value) and "AKIA" not in str(caught.value)


def test_objects_round_trip_with_ranged_reads_and_listings(bucket: str) -> None:
    root = st.join(bucket, "run")
    data = bytes(range(256)) * 4096  # 1 MiB
    st.write(st.join(root, "tag", "a.bin"), data)
    st.write(st.join(root, "tag", "sub", "b.bin"), b"xyz")
    st.write(st.join(root, "latest"), "tag")
    assert st.read_text(st.join(root, "latest")) == "tag"
    assert st.listdir(root) == ["latest", "tag"]
    assert st.isdir(st.join(root, "tag")) and not st.isfile(st.join(root, "tag"))
    assert st.isfile(st.join(root, "tag", "a.bin")) and not st.exists(st.join(root, "nope"))
    assert st.storage_of(root).sizes(st.join(root, "tag")) == {"a.bin": len(data)}
    assert st.find(st.join(root, "tag")) == ["a.bin", "sub/b.bin"]
    blob = st.open_blob(st.join(root, "tag", "a.bin"))
    with stats.counting() as counted:
        out = bytearray(1000)
        blob.readinto([memoryview(out)[:400], memoryview(out)[400:]], 5000)
    assert bytes(out) == data[5000:6000]
    assert (counted.requests, counted.data_bytes) == (1, 1000)  # one ranged GET of exactly the bytes asked for
    assert counted.copied_bytes == 0  # received into the two views, not through a bytes object copied into them
    with pytest.raises(CheckpointError, match=r"a\.bin: truncated: the object ends before byte 1048586"):
        blob.readinto([memoryview(bytearray(20))], len(data) - 10)
    st.delete(st.join(root, "tag"))
    assert st.listdir(root) == ["latest"]


def test_a_store_other_than_s3_is_read_by_range_into_the_views(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "MAX_REQUEST", 300)  # three requests for the 700 bytes below
    path = "memory://ucp-test-ranges/tag/a.bin"
    data = bytes(range(256)) * 8
    st.write(path, data)
    try:
        out = bytearray(700)
        with stats.counting() as counted:
            st.open_blob(path).readinto([memoryview(out)[:250], memoryview(out)[250:]], 100)
        assert bytes(out) == data[100:800]
        # fsspec's other filesystems answer a range with a bytes object: counted as copied into the views
        assert (counted.requests, counted.data_bytes, counted.copied_bytes) == (3, 700, 700)
        with pytest.raises(CheckpointError, match=r"a\.bin: truncated: the object ends before byte 2058"):
            st.open_blob(path).readinto([memoryview(bytearray(20))], len(data) - 10)
    finally:
        st.delete(path)


def test_a_torch_file_on_the_store_is_read_by_range_and_checked(bucket: str) -> None:
    tensors = {"w": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(7)}
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    path = st.join(bucket, "f.pt")
    st.write(path, buffer.getvalue())
    with stats.counting() as counted:
        tfile = TorchFile(path)
        part = tfile.obj["w"].read(1000, 50)
    assert torch.equal(part, tensors["w"][1000:1050])
    # a slice costs its bytes and the archive's directory and pickle, not the object's 1.2 MB
    # requests: the tail (directory), the pickle and the slice, and the local zip header before each record
    assert (counted.data_bytes, counted.requests) == (200, 5) and counted.metadata_bytes < 70_000
    tfile.check_reads()  # the record's CRC covers all of it: the check reads what no read covered
    assert torch.equal(load_file(path)["w"], tensors["w"])
    damaged = bytearray(buffer.getvalue())
    damaged[len(damaged) // 2] ^= 1  # a bit of w, flipped behind our back
    st.write(path, bytes(damaged))
    with pytest.raises(CheckpointError, match=r"f\.pt: record .* fails its crc32 check"):
        load_file(path)
    st.write(path, buffer.getvalue()[: len(damaged) // 2])  # truncated
    with pytest.raises(CheckpointError, match=r"f\.pt: truncated or corrupt"):
        TorchFile(path)


def test_a_missing_bucket_or_object_is_named(s3: S3Server) -> None:
    with pytest.raises(CheckpointError, match=r"s3://no-such-bucket-ucp: the bucket does not exist"):
        st.read("s3://no-such-bucket-ucp/run/latest")
    bucket = s3.bucket()
    with pytest.raises(CheckpointError, match=rf"s3://{bucket}/run/latest: object is missing"):
        st.read(f"s3://{bucket}/run/latest")


def test_a_store_that_went_down_fails_naming_the_object_and_no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "RETRIES", 1)
    monkeypatch.setattr(remote, "BACKOFF", 0.01)
    with s3_server() as down:
        bucket = down.bucket()
        st.write(f"s3://{bucket}/x", b"1")
        down.stop()
        with pytest.raises(CheckpointError) as caught:
            st.read(f"s3://{bucket}/x")
    assert str(caught.value).startswith(f"s3://{bucket}/x: storage request failed while reading it")
    assert SECRET not in str(caught.value)


def test_throttling_is_retried_with_a_bound(s3: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server answers 503 SlowDown: `RETRIES` of them are absorbed, one more fails naming the object."""
    monkeypatch.setattr(remote, "BACKOFF", 0.001)
    st.write(st.join(bucket, "o"), b"abc")
    s3.throttle(remote.RETRIES)
    with stats.counting() as counted:
        assert st.read(st.join(bucket, "o")) == b"abc"
    assert counted.requests == 1  # what the caller asked for; the retries are the storage layer's
    s3.throttle(remote.RETRIES + 1)
    with pytest.raises(CheckpointError, match=r"/o: storage request failed while reading it \(.*reduce your request"):
        st.read(st.join(bucket, "o"))
    s3.throttle(0)


def test_wrong_credentials_name_the_bucket_and_never_the_secret(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import moto.settings

    bucket = s3.bucket()
    st.write(f"s3://{bucket}/o", b"1")
    wrong = "wrong-secret-value-4d2e81"
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # the server checks signatures from now on
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    with caplog.at_level("DEBUG"), pytest.raises(CheckpointError) as caught:
        st.read(f"s3://{bucket}/o")
    assert str(caught.value).startswith(f"s3://{bucket}: access denied while reading s3://{bucket}/o")
    assert wrong not in str(caught.value) + caplog.text and SECRET not in str(caught.value) + caplog.text


def test_a_secret_a_library_puts_in_its_error_is_scrubbed(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore names no secret in its errors today; if a library ever did, the message still would not."""
    store = st.storage_of(bucket)
    assert isinstance(store, st.FsspecStorage)
    monkeypatch.setattr(store, "options", {"client_kwargs": {"aws_session_token": "tok-0123456789"}})

    def leaky(*_args: object, **_kwargs: object) -> bytes:
        raise OSError(f"signature mismatch for {SECRET} with token tok-0123456789")

    monkeypatch.setattr(store.fs, "cat_file", leaky)
    with pytest.raises(CheckpointError) as caught:
        st.read(st.join(bucket, "o"))
    assert "signature mismatch for *** with token ***" in str(caught.value)


def test_inside_listed_lookups_are_answered_from_one_listing_per_folder(bucket: str) -> None:
    """A load's lookups (is there an object, its size and time, a folder) cost one listing per folder, and answer
    what the HEADs answer; outside the block each costs its own round trip again."""
    root = st.join(bucket, "run")
    st.write(st.join(root, "tag", "a.pt"), b"x" * 100)
    st.write(st.join(root, "tag", "b.pt"), b"y" * 7)
    st.write(st.join(root, "latest"), b"tag")
    questions = [
        lambda: st.isfile(st.join(root, "tag", "a.pt")),
        lambda: st.isfile(st.join(root, "tag", "missing")),
        lambda: st.size(st.join(root, "tag", "b.pt")),
        lambda: st.stat(st.join(root, "tag", "a.pt")),
        lambda: st.mtime(st.join(root, "tag", "b.pt")) > 0,
        lambda: st.isdir(st.join(root, "tag")),
        lambda: st.isfile(st.join(root, "latest")),
        lambda: st.exists(st.join(root, "nothing")),
    ]
    with stats.counting() as plain:
        expected = [ask() for ask in questions]
    with stats.counting() as counted, st.listed():
        answers = [ask() for ask in questions]
    assert answers == expected == [True, False, 7, expected[3], True, True, True, False]
    # the listings of `run/tag` and `run`, `exists` of a missing path lists it too, and `stat` is always a HEAD (a
    # conversion's fingerprint compares HEAD times, whose precision a listing's may not share)
    assert counted.lookups == 4 and plain.lookups > 2 * counted.lookups
    with stats.counting() as after:
        st.isfile(st.join(root, "tag", "a.pt"))
    assert after.lookups == 1  # nothing outlives the block


def test_inside_listed_a_write_is_seen_by_the_next_lookup(bucket: str) -> None:
    """A load that imports a foreign folder or materializes a chain into the store writes during the block: what it
    wrote is there for the reader it opens next."""
    out = st.join(bucket, "run", "imported.ucp")
    with st.listed():
        assert not st.isfile(st.join(out, "manifest.json"))
        st.write(st.join(out, "manifest.json"), b"{}")
        assert st.isfile(st.join(out, "manifest.json")) and st.size(st.join(out, "manifest.json")) == 2
        st.delete(out)
        assert not st.exists(out)


def test_inside_listed_a_missing_bucket_is_still_named(s3: S3Server) -> None:
    with st.listed(), pytest.raises(CheckpointError, match=r"the bucket does not exist"):
        st.isfile("s3://no-such-bucket-ucp/run/latest")


@pytest.mark.parametrize(
    "failure",
    [
        'ConnectionClosedError: Connection was closed before we received a valid response from endpoint URL: "x"',
        "ClientError: An error occurred (SlowDown) when calling the PutObject operation: Please reduce your rate",
        "ServerDisconnectedError: Server disconnected",
        "ResponseStreamingError: An error occurred while reading from response stream: Connection reset",
    ],
)
def test_a_dropped_or_throttled_request_is_sent_again(failure: str) -> None:
    # botocore's ConnectionClosedError: a server (s3rver, seen in the benchmark) closed a kept-alive connection just
    # as a multipart upload began; sending it again is what every S3 client does
    assert remote._retryable(RuntimeError(failure))
    assert not remote._retryable(RuntimeError("AccessDenied: Forbidden"))


def _upload_parts(monkeypatch: pytest.MonkeyPatch, fail: Callable[[int], str | None]) -> list[str]:
    """Parts of 5 MiB (S3's least) and s3fs's calls to the store recorded; `fail(n)` may name an error for the nth
    part sent."""
    import s3fs

    monkeypatch.setattr(remote, "PART", 5 << 20)
    monkeypatch.setattr(remote, "BACKOFF", 0.001)
    calls: list[str] = []
    real = s3fs.S3FileSystem._call_s3

    async def call_s3(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(method)
        if method == "upload_part" and (error := fail(calls.count("upload_part"))):
            raise RuntimeError(error)
        return await real(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", call_s3)
    return calls


def test_a_large_object_streams_through_a_local_spool_and_goes_up_in_parts(
    bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store's writer is a file on local disk, not memory; what it holds goes up as a multipart upload; a part the
    store throttles sends the upload again from the spool, and the object is whole."""
    calls = _upload_parts(monkeypatch, lambda n: "SlowDown: reduce your request rate" if n == 2 else None)
    data = torch.randint(0, 256, (13 << 20,), dtype=torch.uint8).numpy().tobytes()
    with st.writer(st.join(bucket, "big.bin")) as out:
        out.write(data[:1000])
        out.write(data[1000:])
        spool = out.name
        assert os.path.isfile(spool) and os.path.getsize(spool) == len(data)
    assert not os.path.exists(spool)  # the spool is gone once sent
    assert calls.count("create_multipart_upload") == 2 and calls.count("complete_multipart_upload") == 1
    assert calls.count("upload_part") == 3 + 3  # 13 MiB in parts of 5: once cut short at the second, then whole
    assert st.read(st.join(bucket, "big.bin")) == data


def test_a_failed_upload_or_writer_leaves_no_object(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A part refused, or a writer whose block raises: no object, no multipart upload left open, no spool left."""
    import boto3

    _upload_parts(monkeypatch, lambda n: "AccessDenied: Forbidden" if n == 2 else None)
    with pytest.raises(CheckpointError, match=r"access denied while writing s3://.*/big.bin"):
        with st.writer(st.join(bucket, "big.bin")) as out:
            out.write(bytes(13 << 20))
            spool = out.name
    with pytest.raises(ValueError, match="cut short"), st.writer(st.join(bucket, "cut.bin")) as out:
        out.write(b"partial")
        raise ValueError("cut short")
    assert not os.path.exists(spool) and not os.path.exists(out.name)
    assert st.listdir(bucket) == []
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
    assert not client.list_multipart_uploads(Bucket=bucket.removeprefix("s3://")).get("Uploads")


def test_a_spread_tag_folder_reads_as_one_folder_and_is_deleted_whole(bucket: str) -> None:
    root, spread = st.join(bucket, "spread"), Spread(4)
    tag = st.join(root, "global_step3")
    names = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(6)] + ["mp_rank_00_model_states.pt"]
    st.place(tag, spread)
    try:
        st.write(st.join(tag, KEYS), spread.to_json())
        for i, name in enumerate(names):
            with st.writer(st.join(tag, name)) as out:
                out.write(bytes([i]) * (100 + i))
    finally:
        st.unplace(tag)
    st.write(st.join(root, "latest"), "global_step3")
    fs = st.storage_of(root).fs  # type: ignore[attr-defined]
    key = bucket.split("://")[1]
    # where the objects are: only the keys object in the tag folder, the rest under the prefixes beside it
    assert fs.ls(f"{key}/spread/global_step3", detail=False) == [f"{key}/spread/global_step3/{KEYS}"]
    placed = sorted(fs.find(f"{key}/spread/{SPREAD}"))
    assert placed == sorted(f"{key}/spread/{SPREAD}/{spread.prefix(n)}/global_step3/{n}" for n in names)
    assert len({spread.prefix(n) for n in names}) > 1
    for listed in (st.listed, contextlib.nullcontext):  # a load's block, and one lookup at a time
        st.storage_of(root)._learned.clear()  # type: ignore[attr-defined]  # looked up afresh each time
        with listed():
            assert st.listdir(tag) == sorted([KEYS, *names])
            assert st.storage_of(tag).sizes(tag) == {
                KEYS: len(spread.to_json()),
                **{n: 100 + i for i, n in enumerate(names)},
            }
            assert st.isfile(st.join(tag, names[2])) and st.size(st.join(tag, names[2])) == 102
            assert st.read(st.join(tag, names[5])) == bytes([5]) * 105
            out = bytearray(3)
            st.open_blob(st.join(tag, names[1])).readinto([memoryview(out)], 10)
            assert bytes(out) == b"\x01\x01\x01"
    assert st.find(tag) == sorted([KEYS, *names])
    assert st.listdir(root) == sorted(["global_step3", "latest", SPREAD])
    st.delete(tag)
    assert fs.find(f"{key}/spread/{SPREAD}") == [] and st.listdir(root) == ["latest"]


def test_a_spread_tag_lists_only_what_its_keys_object_places_and_a_bad_one_is_refused(bucket: str) -> None:
    root, spread = st.join(bucket, "misplaced"), Spread(2)
    tag = st.join(root, "t")
    fs, key = st.storage_of(root).fs, root[len("s3://") :]  # type: ignore[attr-defined]
    st.write(st.join(tag, KEYS), spread.to_json())
    wrong = "1" if spread.prefix("a.pt") == "0" else "0"
    fs.pipe_file(f"{key}/{SPREAD}/{wrong}/t/a.pt", b"misplaced")
    fs.pipe_file(f"{key}/t/b.pt", b"beside the keys object")
    st.write(st.join(tag, "c.pt"), b"placed")  # where the keys object places it
    fs.pipe_file(f"{key}/t/c.pt", b"a second one, in the tag folder")
    with st.listed():
        assert st.listdir(tag) == ["c.pt", KEYS]  # what a read reaches, and nothing else
        assert st.read(st.join(tag, "c.pt")) == b"placed"
        with pytest.raises(CheckpointError, match=r"misplaced/t/a\.pt: object is missing"):
            st.read(st.join(tag, "a.pt"))
    st.write(st.join(tag, KEYS), b'{"format": "ucp_deepspeed/keys", "version": 1, "prefixes": 0}')
    with pytest.raises(st.PlacementError, match=rf"t/{KEYS}: keys object: prefixes must be an integer from 2"):
        st.read(st.join(tag, "c.pt"))
    assert is_tag_folder(tag) and st.isdir(tag)  # ours, never complete, and still deleted whole
    st.delete(tag)
    assert fs.find(key) == []


def test_a_bucket_is_never_spread(bucket: str) -> None:
    with pytest.raises(CheckpointError, match="a bucket is not a tag folder"):
        st.place(bucket, Spread(2))
    st.write(st.join(bucket, KEYS), Spread(2).to_json())
    st.write(st.join(bucket, "latest"), "t")
    assert st.read_text(st.join(bucket, "latest")) == "t"
    fs, key = st.storage_of(bucket).fs, bucket[len("s3://") :]  # type: ignore[attr-defined]
    assert fs.isfile(f"{key}/latest")
