"""The layout language: rules that say how a tensor-parallel parameter is split, for models we cannot introspect.

A rule is a JSON object: `{"match": REGEX, "layout": "replicated" | "average" | "split", "dim": D,
"parts": [sizes...], "vocab": V, "shards": [[each rank's length] per part]}`. The first rule whose regex matches
the whole parameter name wins.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ucp_deepspeed.geometry.layout import Layout


@dataclass(frozen=True)
class Rule:
    """One line of the layout language: parameters whose name fully matches `pattern` get `layout`."""

    pattern: str
    layout: Layout

    def matches(self, name: str) -> bool:
        """Whether the rule applies to a parameter name."""
        return re.fullmatch(self.pattern, name) is not None


def parse_rules(raw: Sequence[dict[str, Any]] | str | None) -> tuple[Rule, ...]:
    """Rules from a list of dicts or a JSON file path, with errors that name the bad rule."""
    if raw is None:
        return ()
    if isinstance(raw, str):
        with open(raw) as f:
            raw = json.load(f)
    rules = []
    for i, item in enumerate(raw):
        try:
            unknown = set(item) - {"match", "layout", "dim", "parts", "vocab", "shards"}
            if unknown:
                raise ValueError(f"unknown keys {sorted(unknown)}")
            re.compile(item["match"])
            layout = Layout.from_json(
                {"kind": item["layout"], **{k: item[k] for k in ("dim", "parts", "vocab", "shards") if k in item}}
            )
        except (KeyError, ValueError, TypeError, re.error) as exc:
            raise ValueError(f"layout rule {i} {item!r}: {exc}") from None
        rules.append(Rule(item["match"], layout))
    return tuple(rules)
