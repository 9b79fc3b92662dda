"""Test launches only (conftest puts this folder on PYTHONPATH): answer DeepSpeed's CPU probe from the value the
test session measured once.

DeepSpeed's CPU op builders call `cpuinfo.get_cpu_info()` each time an op loads (the shm comm op at every
engine, cpu_adam with offload); py-cpuinfo runs it in a subprocess, about 1.2 s a call. Every rank of every
test launch paid it again for the same machine. The library and the launch scripts are unchanged.

Being first on PYTHONPATH, this file hides any other `sitecustomize` in test launches (the virtualenv of
`.ci/install` has none). The probe passes through JSON, so its tuples come back as lists; DeepSpeed reads only
`arch`, `flags` and `vendor_id_raw`.
"""

from __future__ import annotations

import json
import os

_PROBED = os.environ.get("UCP_TEST_CPU_INFO")
if _PROBED:
    import cpuinfo

    _info = json.loads(_PROBED)
    cpuinfo.get_cpu_info = lambda: dict(_info)

# a decoupled FastPersist writer's spawned process needs the CPU shims its parent applied (tests/fastpersist_cpu.py)
if os.environ.get("UCP_TEST_FASTPERSIST"):
    import fastpersist_cpu

    fastpersist_cpu.enable()
