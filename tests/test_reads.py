"""Merged reads of a torch archive go straight into their targets: one scatter list per run of spans, the bytes
between spans in scratch views, nothing read twice for the CRC check, and a read that lands where it should."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.io import stats
from ucp_deepspeed.io.local import LocalBlob
from ucp_deepspeed.io.torch_file import TorchFile, read_spans


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) if len(view) else 0


@pytest.fixture
def archive(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = {"a": torch.arange(10_000, dtype=torch.float32), "b": torch.arange(30_000, dtype=torch.float32) * 2}
    path = tmp_path / "f.pt"
    torch.save(tensors, path)
    return path, tensors


def _span(tfile: TorchFile, key: str, start: int, out: torch.Tensor) -> tuple[str, int, int, torch.Tensor]:
    lazy = tfile.obj[key]
    return (*tfile.storage_span(lazy.key, lazy.dtype, lazy.storage_offset + start, out.numel()), out)


def test_a_run_with_gaps_is_read_in_one_request_straight_into_its_targets(archive, monkeypatch):
    """Two ranges of one record with elements between them, and a range of the next record past its zip header:
    one request whose scatter list holds the targets themselves, no buffer that is then copied out."""
    path, tensors = archive
    tfile = TorchFile(str(path))
    outs = [torch.empty(1000), torch.empty(2000), torch.empty(500)]
    spans = [_span(tfile, "a", 100, outs[0]), _span(tfile, "a", 1500, outs[1]), _span(tfile, "b", 0, outs[2])]
    sent: list[list[int]] = []
    original = LocalBlob.readinto

    def readinto(self, views, offset, data=True):
        sent.append([_address(v) for v in views])
        original(self, views, offset, data)

    monkeypatch.setattr(LocalBlob, "readinto", readinto)
    with stats.counting() as counted:
        tfile.read_spans(spans)
    assert counted.requests == 1 and len(sent) == 1
    assert all(out.data_ptr() in sent[0] for out in outs), "a target was filled through another buffer"
    assert torch.equal(outs[0], tensors["a"][100:1100]) and torch.equal(outs[1], tensors["a"][1500:3500])
    assert torch.equal(outs[2], tensors["b"][:500])
    tfile.close()


def test_a_long_run_on_a_store_is_cut_into_requests_sent_side_by_side(archive, monkeypatch):
    """On a store (a blob with a `request_size` and `concurrency`), one run longer than a request is sent as
    several requests of at most that size, in flight together; every target gets its bytes, and the pieces they
    leave for the CRC check (record a's gap among them) make the check pass without reading them again."""
    path, tensors = archive
    tfile = TorchFile(str(path))
    monkeypatch.setattr(LocalBlob, "request_size", 3000)
    monkeypatch.setattr(LocalBlob, "concurrency", 4)
    sizes: list[int] = []
    original = LocalBlob.readinto

    def readinto(self, views, offset, data=True):
        if data:  # not the zip headers
            sizes.append(sum(len(v) for v in views))
        original(self, views, offset, data)

    monkeypatch.setattr(LocalBlob, "readinto", readinto)
    outs = [torch.empty(1000), torch.empty(2000), torch.empty(500)]
    spans = [_span(tfile, "a", 100, outs[0]), _span(tfile, "a", 1500, outs[1]), _span(tfile, "b", 0, outs[2])]
    read_spans({tfile: spans})
    run = spans[2][2] + 500 * 4 - spans[0][2]  # from the first target's first byte to the last's last
    assert sum(sizes) == run and max(sizes) == 3000 and len(sizes) == -(-run // 3000)
    assert torch.equal(outs[0], tensors["a"][100:1100]) and torch.equal(outs[1], tensors["a"][1500:3500])
    assert torch.equal(outs[2], tensors["b"][:500])
    with stats.counting() as counted:
        tfile.check_reads()
    assert counted.data_bytes + counted.metadata_bytes == (100 + 6500 + 29_500) * 4  # what no request covered
    tfile.close()


def test_the_gap_inside_a_record_counts_for_its_crc_check(archive):
    """The elements between two ranges of one record were read anyway: the CRC check reads only what no read
    covered (the rest of each record), not the gap again."""
    path, _ = archive
    tfile = TorchFile(str(path))
    a, b = torch.empty(1000), torch.empty(2000)
    tfile.read_spans([_span(tfile, "a", 0, a), _span(tfile, "a", 1500, b)])
    with stats.counting() as counted:
        tfile.check_reads()
    # record a: elements 3500..10000 are all that is left of it; the 500 elements of the gap are not read again
    assert counted.data_bytes + counted.metadata_bytes == (10_000 - 3500) * 4
    tfile.close()


def test_overlapping_spans_each_get_their_bytes(archive):
    path, tensors = archive
    tfile = TorchFile(str(path))
    first, second = torch.empty(1000), torch.empty(1000)
    tfile.read_spans([_span(tfile, "a", 0, first), _span(tfile, "a", 500, second)])
    assert torch.equal(first, tensors["a"][:1000]) and torch.equal(second, tensors["a"][500:1500])
    tfile.check_reads()
    tfile.close()


def test_a_damaged_gap_fails_the_check_without_a_second_read(archive):
    """A flipped byte in the elements between two read ranges is found by the record's CRC-32, from the bytes the
    merged read already brought in."""
    path, _ = archive
    data = bytearray(path.read_bytes())
    tfile = TorchFile(str(path))
    lazy = tfile.obj["a"]
    _, _, at = tfile.storage_span(lazy.key, lazy.dtype, 1200, 1)
    tfile.close()
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    tfile = TorchFile(str(path))
    tfile.read_spans([_span(tfile, "a", 0, torch.empty(1000)), _span(tfile, "a", 1500, torch.empty(8500))])
    with stats.counting() as counted, pytest.raises(CheckpointError, match="fails its crc32 check"):
        tfile.check_reads()
    assert counted.data_bytes + counted.metadata_bytes == 0
    tfile.close()


def test_a_save_id_is_stamped_only_on_a_torch_archive_that_is_there(tmp_path):
    """The stamp appends a record to an archive a writer finished. It once opened the file in zip append mode, which
    creates a missing file (a 22-byte empty zip under FastPersist's unsuffixed name) and appends an empty archive to
    a file that is not one; now it refuses both, naming the file, and writes nothing."""
    from ucp_deepspeed.io.torch_file import save_id_of, stamp

    missing, other, archive = tmp_path / "missing.pt", tmp_path / "other.pt", tmp_path / "archive.pt"
    with pytest.raises(CheckpointError, match="missing.pt: missing"):
        stamp(str(missing), "s1")
    assert not missing.exists()
    other.write_bytes(b"not an archive")
    with pytest.raises(CheckpointError, match="no zip directory"):
        stamp(str(other), "s1")
    assert other.read_bytes() == b"not an archive"
    torch.save({"a": torch.ones(2)}, archive)
    stamp(str(archive), "s1")
    assert save_id_of(str(archive)) == "s1"


def test_a_file_fastpersist_stored_in_parts_is_read_under_its_name(tmp_path):
    """FastPersist's data-parallel writers store `<name>-<writer rank>.<writers>`: a missing `..._states.pt` is found
    under its lowest writer's part (numerically: 2 before 10), a listing names it once as DeepSpeed does, a file
    written under the name itself wins, and other names are never looked up."""
    from ucp_deepspeed.io import storage as st

    tag = tmp_path / "global_step1"
    tag.mkdir()
    for rank, data in ((10, b"ten"), (2, b"two")):
        (tag / f"mp_rank_00_model_states.pt-{rank}.12").write_bytes(data)
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt-1.2").write_bytes(b"own")
    (tag / "notes.txt-0.1").write_bytes(b"x")
    model = str(tag / "mp_rank_00_model_states.pt")
    assert st.isfile(model) and st.read(model) == b"two" and st.size(model) == 3
    assert st.listdir(str(tag)) == [
        "mp_rank_00_model_states.pt",
        "notes.txt-0.1",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert st.in_parts(str(tag)) and not st.exists(str(tag / "notes.txt"))
    assert not st.isfile(str(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"whole")
    assert st.read(model) == b"whole"


def test_a_settled_folder_is_listed_once_for_every_missing_name(tmp_path, monkeypatch):
    """A load at 1,000 ranks probes names no save wrote (the bf16 prefix of a non-bf16 tag) once per rank: a folder
    that has not changed is listed once for all of them, and a part written later is still found."""
    import os

    from ucp_deepspeed.io import storage as st

    tag = tmp_path / "global_step1"
    tag.mkdir()
    (tag / "mp_rank_00_model_states.pt-0.2").write_bytes(b"part")
    os.utime(tag, ns=(0, 0))  # settled: older than the clock's grain
    listed = []
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda path=".": listed.append(path) or real(path))
    for rank in range(100):
        assert not st.exists(str(tag / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
    assert len(listed) == 1
    assert st.read(str(tag / "mp_rank_00_model_states.pt")) == b"part"
    (tag / "bf16_zero_pp_rank_7_mp_rank_00_optim_states.pt-0.2").write_bytes(b"new")
    assert st.read(str(tag / "bf16_zero_pp_rank_7_mp_rank_00_optim_states.pt")) == b"new"


def test_crcs_filled_in_are_torchs_own(tmp_path):
    """An archive `torch.save` wrote without its CRC pass gets, from `fill_crcs`, the CRC of every record in its
    central directory and its data descriptor, the same as torch's own pass: zipfile's check passes, the verifying
    load reads it, torch loads it. Without the fill the verifying load refuses it."""
    import zipfile

    from ucp_deepspeed import compat
    from ucp_deepspeed.io.torch_file import fill_crcs, load_file

    state = {"w": torch.randn(1000), "tied": [torch.arange(7)], "step": 3}
    state["view"] = state["w"][10:20]
    torch.save(state, tmp_path / "own.pt")
    with compat.crcs_left_to_us():
        torch.save(state, tmp_path / "filled.pt")
        torch.save(state, tmp_path / "unfilled.pt")
    with pytest.raises(CheckpointError, match="fails its crc32 check"):
        load_file(str(tmp_path / "unfilled.pt"))
    fill_crcs(str(tmp_path / "filled.pt"))

    def crcs(name: str) -> dict[str, tuple[int, int]]:
        """Each record's CRC in the central directory and in the data descriptor after its bytes."""
        data = (tmp_path / name).read_bytes()
        out = {}
        with zipfile.ZipFile(tmp_path / name) as zf:
            assert zf.testzip() is None
            for i in zf.infolist():
                start = (
                    i.header_offset + 30 + int.from_bytes(data[i.header_offset + 26 : i.header_offset + 28], "little")
                )
                start += int.from_bytes(data[i.header_offset + 28 : i.header_offset + 30], "little")
                end = start + i.file_size
                assert data[end : end + 4] == b"PK\x07\x08"
                if "serialization_id" not in i.filename:
                    out[i.filename.split("/", 1)[1]] = (i.CRC, int.from_bytes(data[end + 4 : end + 8], "little"))
        return out

    assert crcs("filled.pt") == crcs("own.pt")
    loaded = load_file(str(tmp_path / "filled.pt"))
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
    assert torch.equal(torch.load(tmp_path / "filled.pt")["view"], state["view"])
    torch.save(state, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    legacy = (tmp_path / "legacy.pt").read_bytes()
    fill_crcs(str(tmp_path / "legacy.pt"))  # no zip, no CRCs: left as it is
    assert (tmp_path / "legacy.pt").read_bytes() == legacy
