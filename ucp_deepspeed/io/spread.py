"""Where a spread save's objects live on a store: over key prefixes that S3 can serve from separate partitions.

S3 serves about 5,500 GETs and 3,500 PUTs a second per partitioned prefix, and a checkpoint's objects all share one
(`<dir>/<tag>/`): at a thousand ranks a load's GETs wait on that rate, not on bandwidth. A tag saved with
`key_prefixes: N` keeps one small object in its folder, `ucp_keys.json` (its format, version and N), and every other
object of the folder at

    <dir>/ucp-keys/<p>/<tag>/<name>

where `<p>` is one of N prefixes picked from the name's CRC-32 and written in reversed binary (`0000`, `1000`, `0100`,
...), so that any point where S3 splits the key range divides the objects evenly. The prefix comes before the tag:
the next checkpoint's objects land in the partitions S3 has already split for this one. Placement is a function of
the tag folder, the name and N alone, so a reader that knows N (from the keys object) finds every object without a
table; an object anywhere else is not the tag's.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass

from ucp_deepspeed.io.checksum import crc32

KEYS = "ucp_keys.json"
"""The object in a spread tag folder that says how many prefixes its other objects are spread over."""
KEYS_FORMAT = "ucp_deepspeed/keys"
SPREAD = "ucp-keys"
"""The folder beside the tags that holds the prefixes."""
MAX_PREFIXES = 1024


@dataclass(frozen=True)
class Spread:
    """A tag folder's placement: its objects spread over `prefixes` key prefixes."""

    prefixes: int

    def prefix(self, name: str) -> str:
        """The prefix of an object of the folder, by its name."""
        return self._label(crc32(name.encode()) % self.prefixes)

    def _label(self, index: int) -> str:
        """Prefix `index` in reversed binary, as wide as the largest needs."""
        return format(index, f"0{max(1, (self.prefixes - 1).bit_length())}b")[::-1]

    def location(self, folder: str, name: str) -> str:
        """Where the object `name` of the tag folder `folder` lives."""
        parent, tag = posixpath.split(folder.rstrip("/"))
        return posixpath.join(parent, SPREAD, self.prefix(name), tag, name)

    def folders(self, folder: str) -> dict[str, str]:
        """Each prefix -> the folder that holds the tag's objects under it."""
        parent, tag = posixpath.split(folder.rstrip("/"))
        return {p: posixpath.join(parent, SPREAD, p, tag) for p in map(self._label, range(self.prefixes))}

    def to_json(self) -> bytes:
        """The keys object's content."""
        return json.dumps({"format": KEYS_FORMAT, "version": 1, "prefixes": self.prefixes}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Spread:
        """Parse a keys object; ValueError with the reason when it is not one."""
        try:
            raw = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"not valid JSON ({exc})") from None
        if not isinstance(raw, dict) or raw.get("format") != KEYS_FORMAT or raw.get("version") != 1:
            raise ValueError("not a ucp_deepspeed keys object (format or version)")
        prefixes = raw.get("prefixes")
        if type(prefixes) is not int or not 2 <= prefixes <= MAX_PREFIXES:
            raise ValueError(f"prefixes must be an integer from 2 to {MAX_PREFIXES}, not {prefixes!r}")
        return cls(prefixes)
