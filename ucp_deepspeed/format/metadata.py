"""Save-time metadata: what conversion needs to know that DeepSpeed's own files leave implicit.

Written next to DeepSpeed's files as `ucp_meta_mp_rank_XX.json`, one per model-parallel rank, so a
checkpoint can be converted with no model code and no flags.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ucp_deepspeed.errors import CheckpointError
from ucp_deepspeed.format.manifest import check_optimizer_record
from ucp_deepspeed.format.model import ModelSpec
from ucp_deepspeed.format.topology import Topology
from ucp_deepspeed.geometry.layout import REPLICATED, Layout
from ucp_deepspeed.io import storage as st

META_VERSION = 1
FP32 = "fp32"  # state name of the fp32 master weight, next to optimizer states such as exp_avg
VALUE = "value"  # state name of a frozen parameter's only tensor


LAYER_FILE = re.compile(r"layer_[0-9]+(-[a-z]+_[0-9]+)*-model_states\.pt")
"""A `PipelineModule` layer file, e.g. `layer_03-model_01-model_states.pt`."""


def meta_filename(mp_rank: int = 0) -> str:
    """Name of the metadata file of one model-parallel rank, mirroring DeepSpeed's naming."""
    return f"ucp_meta_mp_rank_{mp_rank:02d}.json"


def check_name(name: str) -> None:
    """Refuse a tensor name that could not be a file name: names read from disk become `params/<name>.safetensors`."""
    if not name or any(c in name for c in "/\\\0"):
        raise ValueError(f"tensor name {name!r} is empty or holds a path separator or NUL")


def _check_layer_file(name: str, file: str) -> None:
    # a name read from disk becomes a path: only DeepSpeed's own layer-file names, never a way out of the tag
    check_name(name)
    if file and not LAYER_FILE.fullmatch(file):
        raise ValueError(f"'{name}' names {file!r}, which is not a pipeline layer file")


@dataclass(frozen=True)
class ParamSlot:
    """Where a trainable parameter's fp32 master and optimizer states live in the flat buffers.

    ZeRO-1/2: `offset` is the element offset in the un-partitioned flat buffer `flat`, which is split
    into contiguous chunks of `partition` elements, one per data-parallel rank.
    ZeRO-3: every rank holds `partition` elements of this parameter (rank r: elements
    [r*partition, (r+1)*partition)) at element `offset` of its flat sub-group `flat`.
    `name` is the global name in the full model, `local` the name in this rank's module when it
    differs (pipeline stages number layers locally); `shape` is the local, tensor-parallel shape.
    An `alias` is a second copy of another parameter (a tied output layer on the last stage).
    `ranks` lists the data-parallel ranks whose files hold partitions 0, 1, ... when they are not
    all ranks in order: an expert's partitions live in its expert-data-parallel group's files.
    ZeRO-0 in fp32 has no flat buffers: the parameter is its own fp32 master, in the model-states file
    (or the pipeline layer file `file`, under `key`), and its states are entry `flat` of the torch
    optimizer's state dict, saved in the model-states file; `offset` is 0 and `partition` its size.
    A layout cut over the expert-parallel ranks (AutoEP's expert stacks) lists one slot per
    expert-parallel rank in the model-parallel rank's metadata: `ep_rank` says whose run it is.
    """

    name: str
    shape: tuple[int, ...]
    group: int
    flat: int
    offset: int
    partition: int
    layout: Layout = REPLICATED
    local: str = ""
    alias: bool = False
    ranks: tuple[int, ...] = ()
    file: str = ""
    key: str = ""
    ep_rank: int = 0

    def __post_init__(self) -> None:
        _check_layer_file(self.name, self.file)

    @property
    def numel(self) -> int:
        """Number of elements of this rank's (tensor-parallel) parameter."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class ExtraTensor:
    """A tensor the optimizer does not own: a frozen parameter or a persistent buffer.

    `partition` is non-zero for ZeRO-3 frozen parameters, which are stored as per-rank fragments.
    A `PipelineModule` saves its layers' tensors in per-layer files: `file` names the one in the tag
    folder that holds this tensor, under `key`; empty means the rank's model-states file, under the
    local name.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    partition: int = 0
    layout: Layout = REPLICATED
    local: str = ""
    file: str = ""
    key: str = ""

    def __post_init__(self) -> None:
        _check_layer_file(self.name, self.file)

    @property
    def local_name(self) -> str:
        """Name in this rank's module."""
        return self.local or self.name


@dataclass(frozen=True)
class SaveMeta:
    """Everything conversion needs about one model-parallel rank's part of a checkpoint.

    `save_id` is carried by every file the save wrote (`torch_file.stamp`), binding them together.
    `model` describes a megatron-core GPT (None for other modules); `hf_config` is the `config.json` of the
    Hugging Face model the run was imported from, carried from load to save so an export keeps its
    fields (token ids, `model_type`) that megatron-core has no place for. `optimizer` is the base optimizer's
    class, algorithm and state names (`compat.Kernel`), so another implementation can take its state.
    """

    topology: Topology
    params: tuple[ParamSlot, ...]
    extras: tuple[ExtraTensor, ...]
    tied: dict[str, str] = field(default_factory=dict)
    num_groups: int = 1
    client_state_keys: tuple[str, ...] = ()
    versions: dict[str, str] = field(default_factory=dict)
    tp_rank: int = 0
    pp_rank: int = 0
    frozen_excluded: bool = False
    save_id: str = ""
    model: ModelSpec | None = None
    hf_config: dict[str, Any] | None = None
    optimizer: dict[str, Any] | None = None
    data_sampler_rng: dict[str, Any] | None = None
    """The numpy generator state of DeepSpeed's data sampler (`np_rng`), which DeepSpeed's own `data_sampler` entry
    leaves out: without it a resumed sampler shuffles from its seed again."""
    data_loaders: int | None = None
    """How many ranks' data-loader records the tag's `data_loader.pt` holds (`format.data_position`); None when the
    save was given no data loader (a file an earlier save of the tag left is then not read)."""
    version: int = META_VERSION

    def to_json(self) -> str:
        """Serialise to the JSON stored in the checkpoint folder."""
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str, path: str) -> SaveMeta:
        """Parse and validate a metadata file, naming `path` in any error."""
        try:
            raw: dict[str, Any] = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CheckpointError(path, f"metadata is not valid JSON ({exc})") from None
        if raw.get("version") != META_VERSION:
            raise CheckpointError(
                path,
                f"unknown metadata version {raw.get('version')!r}; this ucp_deepspeed reads version {META_VERSION}",
            )
        try:
            return cls(
                topology=Topology.decode(raw["topology"]),
                params=tuple(ParamSlot(**_tensor_fields(p)) for p in raw["params"]),
                extras=tuple(ExtraTensor(**_tensor_fields(e)) for e in raw["extras"]),
                tied=dict(raw["tied"]),
                num_groups=raw["num_groups"],
                client_state_keys=tuple(raw["client_state_keys"]),
                versions=dict(raw["versions"]),
                tp_rank=raw.get("tp_rank", 0),
                pp_rank=raw.get("pp_rank", 0),
                frozen_excluded=raw.get("frozen_excluded", False),
                save_id=str(raw.get("save_id", "")),
                model=ModelSpec.decode(raw["model"]) if raw.get("model") is not None else None,
                hf_config=_object(raw.get("hf_config"), "hf_config"),
                optimizer=check_optimizer_record(raw.get("optimizer")),
                data_sampler_rng=_object(raw.get("data_sampler_rng"), "data_sampler_rng"),
                data_loaders=_count(raw.get("data_loaders"), "data_loaders"),
                version=raw["version"],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(path, f"metadata is missing or has malformed fields ({exc})") from None


def _count(value: Any, what: str) -> int | None:
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError(f"{what} is {value!r}, not a rank count")
    return value


def _object(value: Any, what: str) -> dict[str, Any] | None:
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{what} is not an object")
    return value


def _tensor_fields(raw: dict[str, Any]) -> dict[str, Any]:
    out = {**raw, "shape": tuple(raw["shape"])}
    if "ranks" in raw:
        out["ranks"] = tuple(raw["ranks"])
    if "layout" in raw:
        out["layout"] = Layout.from_json(raw["layout"])
    return out


def write_meta(meta: SaveMeta, tag_dir: str, mp_rank: int = 0) -> str:
    """Atomically write the metadata of one model-parallel rank into a checkpoint tag folder."""
    st.makedirs(tag_dir)
    path = st.join(tag_dir, meta_filename(mp_rank))
    st.write(path, meta.to_json().encode())
    return path


def read_meta(tag_dir: str, mp_rank: int = 0) -> SaveMeta:
    """Read the metadata of one model-parallel rank from a checkpoint tag folder."""
    path = st.join(tag_dir, meta_filename(mp_rank))
    if not st.isfile(path):
        raise CheckpointError(
            path,
            "ucp_deepspeed metadata is missing; was this checkpoint saved through "
            'ucp_deepspeed.initialize with "checkpoint": {"universal": true}?',
        )
    text = st.read_text(path)
    return SaveMeta.from_json(text, path)
