"""The `"checkpoint": {"universal": ...}` section of ds_config, validated in DeepSpeed's style."""

from __future__ import annotations

import copy
import json
from typing import Any, Literal

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import ConfigDict, Field, ValidationError, field_validator

from ucp_deepspeed.io.spread import MAX_PREFIXES
from ucp_deepspeed.naming.rules import parse_rules
from ucp_deepspeed.runtime.plugins import sections


class UniversalConfig(DeepSpeedConfigModel):
    """Options of universal checkpointing; `"universal": true` is short for `{"enabled": true}`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    """Save ucp metadata and reshard on load when the topology changed."""
    workers: int = Field(1, ge=1)
    """Writer threads per rank during conversion."""
    output: str | None = None
    """Folder for converted copies (`<output>/<tag>`); default `<checkpoint dir>/<tag>.universal`."""
    direct: bool = True
    """Reshard straight from the saved rank files: each rank reads only what it needs, and no universal copy is
    written. Measured faster than DeepSpeed's own same-layout load (docs/benchmarks.md). `false` converts the tag
    to a universal copy first and restores from that."""
    keep: bool = True
    """With `direct: false`, keep the converted copy after loading, so the next reshard of the tag skips conversion."""
    keep_last: int | None = Field(None, ge=1)
    """Retention: after each save, keep this many newest complete tags (and the older ones a kept Check-N-Run delta
    needs) and delete the rest with their converted copies; never the tag `latest` names. Unset keeps every tag."""
    verify: bool = True
    """Check every byte a load reads against its CRC (native files, converted copies); off only to measure the cost."""
    progress: bool = True
    """Show a tqdm progress bar on rank 0 during conversion."""
    async_save: bool = False
    """Write checkpoint files in a background thread: `save_checkpoint` returns once the state is in host memory."""
    async_writer_cpus: list[int] | None = None
    """The CPUs each rank's async writer process runs on (Linux); unset, the rank's own. Where ranks are bound to
    cores (`deepspeed --bind_cores_to_rank`, numactl) the writer would share its rank's: name cores no rank trains
    on (the writer inherits its rank's CPUs otherwise). docs/benchmarks.md measures the stall with and without."""
    refresh: Literal["auto", "read", "gather"] = "auto"
    """How a ZeRO-1/2 restore rebuilds the low-precision weights, whose partitions other ranks hold: `read` reads
    the rank's whole tensor- and pipeline-parallel share of fp32 masters again (4 bytes per parameter per rank, from
    storage), `gather` all-gathers the partitions over the data-parallel group as DeepSpeed does after a step (no
    read). `auto` gathers except on gloo, where reading measured faster."""
    wait_minutes: float = Field(60.0, gt=0)
    """How long a rank waits for another during a save or load (rank 0 picking and checking a tag, importing,
    replaying a Check-N-Run chain) before the load fails on every rank. These waits run on a gloo group of their
    own, so the training group's timeout (NCCL's 10 minutes) does not bound them."""
    storage_options: dict[str, Any] = Field(default_factory=dict, repr=False)
    """Passed to the fsspec filesystem of a checkpoint URL (`s3://...`): e.g. `{"endpoint_url": ...}` or
    `{"profile": ...}`. Credentials are best left to the AWS environment variables and config files; given here, they
    reach no file, log line or error."""
    key_prefixes: int = Field(0, ge=0, le=MAX_PREFIXES)
    """On an object store, spread each save's objects over this many key prefixes (`<dir>/ucp-keys/<p>/<tag>/`), so
    that S3 serves a large job's requests from as many partitions (docs/guides/object-storage.md); 0 keeps them in
    the tag folder. Loads find either layout without it."""
    extensions: dict[str, Any] = Field(default_factory=dict)
    """Sections extensions registered (`plugins.register_section`), e.g. Check-N-Run's `differential`, by name."""
    vocab_size: int = Field(0, ge=0)
    """Unpadded vocabulary size: vocab-parallel embedding/output rows beyond it are padding, dropped on conversion."""
    layout_rules: str | list[dict[str, Any]] | None = None
    """Layout rules (a list, or a JSON file path) for tensor-parallel models that are not megatron-core."""
    rename: dict[str, str] = Field(default_factory=dict)
    """Name prefixes of this engine's model -> the prefixes its checkpoints use (longest match wins), at save and
    load: e.g. `{"0.": "tied_modules.embed."}` lets a plain module resume a `PipelineModule` checkpoint."""

    @field_validator("key_prefixes")
    @classmethod
    def _prefixes_are_several(cls, value: int) -> int:
        if value == 1:
            raise ValueError("one key prefix spreads nothing: 0 (off) or 2 to 1024")
        return value

    @field_validator("async_writer_cpus")
    @classmethod
    def _cpus_exist(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or min(value) < 0):
            raise ValueError("name one CPU or more, each 0 or above (null: the rank's own)")
        return value

    @field_validator("rename")
    @classmethod
    def _rename_one_to_one(cls, value: dict[str, str]) -> dict[str, str]:
        if len(set(value.values())) != len(value):
            raise ValueError("two model prefixes are renamed to the same checkpoint prefix")
        return value

    @field_validator("layout_rules")
    @classmethod
    def _rules_parse(cls, value: Any) -> Any:
        parse_rules(value)
        return value


def load_config(config: str | dict | None) -> dict[str, Any]:
    """Read a ds_config given as a path or a dict (copied, never mutated)."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return copy.deepcopy(config)
    with open(config) as f:
        return json.load(f)


def split_config(
    config: dict[str, Any], default: bool | dict[str, Any] = False
) -> tuple[dict[str, Any], UniversalConfig]:
    """Separate our options from the config handed to DeepSpeed, validating them.

    `default` stands in for a missing `"checkpoint": {"universal": ...}` (`ucp_deepspeed.install` makes it true).
    """
    ds_config = copy.deepcopy(config)
    section = ds_config.get("checkpoint", {})
    raw = section.pop("universal", default) if isinstance(section, dict) else default
    registered = sections()
    extra = {k: section.pop(k) for k in list(registered) if isinstance(section, dict) and k in section}
    if isinstance(raw, bool):
        raw = {"enabled": raw}
    elif not isinstance(raw, dict):
        raise ValueError(f'"checkpoint.universal" must be true/false or an object, got {raw!r}')
    else:
        raw = {"enabled": True, **raw}
    if extra and not raw.get("enabled", False):
        raise ValueError(" and ".join(f'"checkpoint.{k}"' for k in extra) + ' need "checkpoint.universal" enabled')
    try:
        return ds_config, UniversalConfig(
            **raw, extensions={k: registered[k].model_validate(v) for k, v in extra.items()}
        )
    except ValidationError as exc:
        raise ValueError(f'invalid "checkpoint" config: {exc}') from None
