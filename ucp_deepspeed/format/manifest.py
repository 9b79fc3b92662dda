"""The manifest as frozen dataclasses: every writer builds one, every reader gets a validated one.

`manifest.json` is the universal folder's commit marker (see `universal.py`). Its body says what the
checkpoint holds; `write_manifest` adds the format name, version, block size and file table.
`Manifest.decode` checks types and cross-references (each parameter's file is in the file table,
shapes are non-negative integers, keys are strings) and raises `CheckpointError` naming the file,
never a `KeyError` deep inside a load. Sections an extension adds (Check-N-Run's `differential`,
`save_id`), the recorded model (`model`, `hf_config`) and notes (`weights_only`, `notes`) are kept in
`extra`, untouched; so are the fields an extension adds to a record (`ParamRecord.extra`, `SourceRecord.extra`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any

import torch

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.model import ModelSpec
from ucp_deepspeed.format.topology import Topology
from ucp_deepspeed.io.checksum import BLOCK
from ucp_deepspeed.version import __version__

_BODY = ("created_by", "source", "counters", "param_groups", "params", "buffers", "tied", "frozen_excluded")
_ENVELOPE = ("format", "version", "block_size", "files")


def _shape(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(d) is int and d >= 0 for d in value):
        raise ValueError(f"shape {value!r} is not a list of non-negative integers")
    return tuple(value)


def _dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} is not an object")
    return value


def check_optimizer_record(value: Any) -> dict[str, Any] | None:
    """A saving kernel's record (`class`, `algorithm`, `states`), type-checked; ValueError when malformed."""
    if value is None:
        return None
    record = _dict(value, "optimizer")
    states = _dict(record.get("states", {}), "optimizer.states")
    if not isinstance(record.get("algorithm"), str):
        raise ValueError("optimizer lacks an algorithm name")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in states.items()):
        raise ValueError("optimizer state names are not strings")
    return record


@dataclass(frozen=True)
class FileRecord:
    """A finished output file: its relative path, size, CRC-32, and the CRC-32 of each `BLOCK` of it."""

    path: str
    nbytes: int
    crc32: str
    blocks: str = ""  # 8 hex digits per block

    def to_json(self) -> dict[str, Any]:
        """The manifest's entry for this file."""
        return {"bytes": self.nbytes, "crc32": self.crc32, "blocks": self.blocks}

    @classmethod
    def from_json(cls, path: str, raw: Any, where: str) -> FileRecord:
        """Parse a manifest entry, naming `where` if it is malformed."""
        try:
            record = cls(path, int(raw["bytes"]), str(raw["crc32"]), str(raw.get("blocks", "")))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise CheckpointError(where, f"manifest entry of {path} is malformed") from None
        if record.blocks and len(record.blocks) != 8 * max(1, -(-record.nbytes // BLOCK)):
            raise CheckpointError(
                where, f"manifest entry of {path} has {len(record.blocks) // 8} block CRCs for {record.nbytes} bytes"
            )
        return record


@dataclass(frozen=True)
class SourceRecord:
    """Where a universal checkpoint came from: the tag it was converted, saved or imported from, the layout that
    tag was saved at, the versions that wrote it, and the identity of its files (so a stale copy is never
    reused)."""

    path: str
    tag: str | None
    topology: Topology
    versions: dict[str, str] = field(default_factory=dict)
    fingerprint: tuple[tuple[str | int, ...], ...] = ()
    """Each source file's (name, size, mtime) and the save id: see `convert.output.fingerprint`."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Fields an extension or an importer adds (Check-N-Run's `chain` and `differential`, a foreign `format`)."""

    def encode(self) -> dict[str, Any]:
        """The JSON form."""
        return {
            "path": self.path,
            "tag": self.tag,
            "topology": self.topology.encode(),
            "versions": self.versions,
            "fingerprint": [list(entry) for entry in self.fingerprint],
            **self.extra,
        }

    @classmethod
    def decode(cls, raw: Any) -> SourceRecord:
        """Parse and type-check the JSON form (ValueError on anything malformed)."""
        raw = _dict(raw, "source")
        versions = _dict(raw.get("versions", {}), "source.versions")
        fingerprint = raw.get("fingerprint", [])
        if not isinstance(fingerprint, list) or not all(
            isinstance(e, list) and all(type(x) in (str, int) for x in e) for e in fingerprint
        ):
            raise ValueError("source.fingerprint is not a list of (name, size, mtime) entries")
        if not isinstance(raw.get("path"), str) or not (raw.get("tag") is None or isinstance(raw["tag"], str)):
            raise ValueError("source.path or source.tag is not a string")
        known = ("path", "tag", "topology", "versions", "fingerprint")
        return cls(
            raw["path"],
            raw.get("tag"),
            Topology.decode(raw["topology"]),
            {str(k): str(v) for k, v in versions.items()},
            tuple(tuple(e) for e in fingerprint),
            {k: v for k, v in raw.items() if k not in known},
        )


@dataclass(frozen=True)
class Counters:
    """The engine's step counters at the save; `global_samples` as the data-parallel ranks consumed them (DeepSpeed
    counts each AutoTP tensor-parallel rank's copy of a batch: `compat.sample_copies`)."""

    global_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0

    @property
    def stepped(self) -> bool:
        """Whether an optimizer step ran, so that optimizer state exists."""
        return self.global_steps > self.skipped_steps

    def encode(self) -> dict[str, int]:
        """The JSON form."""
        return asdict(self)

    @classmethod
    def decode(cls, raw: Any) -> Counters:
        """Parse and type-check the JSON form (ValueError on a non-integer or unknown counter)."""
        raw = _dict(raw, "counters")
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})
        if unknown or not all(type(v) is int and v >= 0 for v in raw.values()):
            raise ValueError(f"counters {raw!r} are not the three non-negative step counters")
        return cls(**raw)


def dtype_name(dtype: Any) -> str:
    """A torch dtype as every record names it (`bfloat16`, not `torch.bfloat16`)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ParamRecord:
    """One parameter: its full shape and dtype, its optimizer param group, and the file and keys of its states."""

    shape: tuple[int, ...]
    dtype: str
    group: int | None
    """The optimizer param group; None for frozen parameters."""
    trainable: bool
    file: str
    keys: tuple[str, ...]
    extra: dict[str, Any] = field(default_factory=dict)
    """Fields an extension adds (Check-N-Run's `table`)."""

    def encode(self) -> dict[str, Any]:
        """The JSON form."""
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "group": self.group,
            "trainable": self.trainable,
            "file": self.file,
            "keys": list(self.keys),
            **self.extra,
        }

    @classmethod
    def decode(cls, raw: Any) -> ParamRecord:
        """Parse and type-check one record (ValueError on anything malformed)."""
        raw = _dict(raw, "record")
        keys = raw["keys"]
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) or not keys:
            raise ValueError(f"keys {keys!r} are not a non-empty list of names")
        group = raw["group"]
        if (
            not isinstance(raw["file"], str)
            or not isinstance(raw["dtype"], str)
            or not (group is None or type(group) is int)
        ):
            raise ValueError("file, dtype or group has the wrong type")
        known = ("shape", "dtype", "group", "trainable", "file", "keys")
        return cls(
            _shape(raw["shape"]),
            raw["dtype"],
            raw["group"],
            bool(raw["trainable"]),
            raw["file"],
            tuple(keys),
            {k: v for k, v in raw.items() if k not in known},
        )


@dataclass(frozen=True)
class BufferRecord:
    """One persistent buffer, stored in `buffers.safetensors` under its global name."""

    shape: tuple[int, ...]
    dtype: str

    def encode(self) -> dict[str, Any]:
        """The JSON form."""
        return {"shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def decode(cls, raw: Any) -> BufferRecord:
        """Parse and type-check one record."""
        raw = _dict(raw, "buffer")
        if not isinstance(raw["dtype"], str):
            raise ValueError("dtype is not a string")
        return cls(_shape(raw["shape"]), raw["dtype"])


IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable", "step")
"""Param-group entries that choose how a kernel runs (or, in DeepSpeed's FusedAdam, count steps), not what it
computes: a restore leaves the live optimizer's own."""


@dataclass(frozen=True)
class GroupRecord:
    """One optimizer param group: its hyperparameters (None when the source did not record them) and its
    scalar optimizer state (e.g. Adam's `step`), both in `encode_value` form."""

    hyperparams: dict[str, Any] | None
    scalars: dict[str, Any]

    def encode(self) -> dict[str, Any]:
        """The JSON form."""
        return {"hyperparams": self.hyperparams, "scalars": self.scalars}

    @classmethod
    def decode(cls, raw: Any) -> GroupRecord:
        """Parse and type-check one group."""
        raw = _dict(raw, "param group")
        hyper = raw.get("hyperparams")
        return cls(None if hyper is None else _dict(hyper, "hyperparams"), _dict(raw.get("scalars", {}), "scalars"))


@dataclass(frozen=True)
class Manifest:
    """What a universal folder holds, apart from its file table."""

    created_by: dict[str, str]
    """The versions of the tools that wrote it, by name (`ucp_deepspeed`, `deepspeed`, `torch`)."""
    source: SourceRecord
    counters: Counters
    param_groups: tuple[GroupRecord, ...]
    params: dict[str, ParamRecord]
    buffers: dict[str, BufferRecord]
    tied: dict[str, str] = field(default_factory=dict)
    """Parameters that are copies of another (a last stage's output layer), by global name."""
    frozen_excluded: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    """Top-level sections outside the core body, kept as they are."""
    files: dict[str, FileRecord] = field(default_factory=dict)
    """The file table of a manifest read from disk; writers leave it empty, `write_manifest` adds the table of
    what they wrote."""

    @property
    def weights_only(self) -> bool:
        """Whether the checkpoint holds weights without optimizer state (a Hugging Face import)."""
        return bool(self.extra.get("weights_only"))

    @property
    def model(self) -> ModelSpec | None:
        """The megatron-core GPT this checkpoint holds, when its save (or import) recorded one."""
        raw = self.extra.get("model")
        return None if raw is None else ModelSpec.decode(raw)

    @property
    def optimizer(self) -> dict[str, Any] | None:
        """The saving optimizer: `class`, `algorithm`, and `states` (its state names that differ from the
        algorithm's), when its save recorded them."""
        raw = self.extra.get("optimizer")
        return raw if isinstance(raw, dict) else None

    @property
    def hf_config(self) -> dict[str, Any] | None:
        """The `config.json` of the Hugging Face model this run was imported from, if it was."""
        raw = self.extra.get("hf_config")
        return raw if isinstance(raw, dict) else None

    def section(self, name: str) -> dict[str, Any]:
        """An extension's top-level section (e.g. Check-N-Run's `differential`); empty when absent."""
        value = self.extra.get(name)
        return value if isinstance(value, dict) else {}

    def encode(self) -> dict[str, Any]:
        """The JSON body (without the envelope `write_manifest` adds)."""
        return {
            "created_by": self.created_by,
            "source": self.source.encode(),
            "counters": self.counters.encode(),
            "param_groups": [g.encode() for g in self.param_groups],
            "params": {n: r.encode() for n, r in self.params.items()},
            "buffers": {n: b.encode() for n, b in self.buffers.items()},
            "tied": self.tied,
            "frozen_excluded": self.frozen_excluded,
            **self.extra,
        }

    @classmethod
    def decode(cls, raw: dict[str, Any], where: str) -> Manifest:
        """Parse and validate a manifest read from `where`; a `CheckpointError` naming it when malformed."""
        at = "the manifest"
        try:
            files = {p: FileRecord.from_json(p, r, where) for p, r in _dict(raw.get("files", {}), "files").items()}
            params = {}
            for name, rec in _dict(raw["params"], "params").items():
                at = f"params.{name}"
                params[name] = ParamRecord.decode(rec)
                if files and params[name].file not in files:
                    raise ValueError(f"its file {params[name].file} is not in the file table")
            buffers = {}
            for name, rec in _dict(raw["buffers"], "buffers").items():
                at = f"buffers.{name}"
                buffers[name] = BufferRecord.decode(rec)
            at = "param_groups"
            if not isinstance(raw["param_groups"], list):
                raise ValueError("not a list")
            groups = tuple(GroupRecord.decode(g) for g in raw["param_groups"])
            at = "source"
            source = SourceRecord.decode(raw["source"])
            at = "counters"
            counters = Counters.decode(raw["counters"])
            at = "created_by"
            created_by = {
                str(k): str(v) for k, v in _dict(raw.get("created_by", {}), "created_by").items() if v is not None
            }
            at = "tied"
            tied = _dict(raw.get("tied", {}), "tied")
            at = "model"
            if raw.get("model") is not None:
                ModelSpec.decode(raw["model"])
            if raw.get("hf_config") is not None:
                _dict(raw["hf_config"], "hf_config")
            at = "optimizer"
            check_optimizer_record(raw.get("optimizer"))
            return cls(
                created_by,
                source,
                counters,
                groups,
                params,
                buffers,
                tied,
                bool(raw.get("frozen_excluded", False)),
                {k: v for k, v in raw.items() if k not in _BODY and k not in _ENVELOPE},
                files,
            )
        except KeyError as exc:
            raise CheckpointError(where, f"manifest is malformed: {at} lacks {exc}") from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(where, f"manifest is malformed at {at}: {exc}") from None


def written_by() -> dict[str, str]:
    """The `created_by` of a manifest this process writes: the versions a reader may need to explain a difference."""
    versions = {"ucp_deepspeed": __version__, "torch": torch.__version__}
    try:
        versions["deepspeed"] = package_version("deepspeed")
    except PackageNotFoundError:  # a Hugging Face import needs no DeepSpeed
        pass
    return versions


def recorded_sections(
    model: ModelSpec | None, hf_config: dict[str, Any] | None, optimizer: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The manifest's `model`, `hf_config` and `optimizer` sections (see `Manifest.model`), empty for what is None."""
    return {
        **({"model": model.encode()} if model is not None else {}),
        **({"hf_config": hf_config} if hf_config is not None else {}),
        **({"optimizer": optimizer} if optimizer is not None else {}),
    }
