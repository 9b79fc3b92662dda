"""DeepSpeed's public setters (`safe_set_full_*`, `safe_set_local_*`) against the fragment copies restore.py makes.

    DS_ACCELERATOR=cpu python benchmarks/bench_public_api.py

One process (world size 1), a 16.8M-parameter model, ZeRO-1 and ZeRO-3: both ways write the same
values into the fp32 masters and both Adam moments, and the results are compared. At world size 1 a
rank's fragment is the whole parameter, so this isolates the cost of the calls; at DP > 1 the
public ZeRO-1/2 setters also need the full tensor on every rank.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

KEYS = ("exp_avg", "exp_avg_sq")


def engine(stage: int) -> Any:
    import deepspeed

    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    eng, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-3), config=config)
    eng.backward(eng(torch.randn(1, 1024)).sum())
    eng.step()
    return eng


def public(eng: Any, values: dict[int, torch.Tensor], stage: int) -> None:
    from deepspeed.utils import (
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_optimizer_state,
    )

    from ucp_deepspeed import compat

    for p in eng.module.parameters():
        value = values[id(p)]
        if stage == 3:
            part = compat.zero3_partition(p)
            local = value.view(-1)[part.start : part.start + part.numel]
            safe_set_local_fp32_param(p, local)
            for key in KEYS:
                safe_set_local_optimizer_state(p, local, key)
        else:
            safe_set_full_fp32_param(p, value)
            for key in KEYS:
                safe_set_full_optimizer_state(p, value, key)


def direct(eng: Any, values: dict[int, torch.Tensor], stage: int) -> None:
    from ucp_deepspeed import compat

    opt = eng.optimizer
    if stage == 3:
        for sub in compat.zero3_subgroups(opt):
            state = opt.optimizer.state[sub.fp32]
            for p in sub.params:
                piece = compat.zero3_fragment(opt, p)
                src = values[id(p)].view(-1)[piece.start : piece.start + piece.numel]
                piece.fp32.data.copy_(src)
                for key in KEYS:
                    state[key].narrow(0, piece.offset, piece.numel).copy_(src)
        return
    for group in compat.zero12_groups(opt):
        state = opt.optimizer.state[group.fp32]
        for p in group.params:
            piece = compat.zero12_fragment(p)
            src = values[id(p)].view(-1)[piece.start : piece.start + piece.numel]
            piece.fp32.data.copy_(src)
            for key in KEYS:
                state[key].narrow(0, piece.offset, piece.numel).copy_(src)


def median_ms(fn: Callable[[], None], runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_optimizer_state

    from ucp_deepspeed import compat

    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    for stage in (1, 3):
        eng = engine(stage)
        values = {id(p): torch.randn(compat.full_shape(p)) for p in eng.module.parameters()}
        ours = median_ms(lambda eng=eng, values=values, stage=stage: direct(eng, values, stage))
        theirs = median_ms(lambda eng=eng, values=values, stage=stage: public(eng, values, stage))
        probe = next(iter(eng.module.parameters()))
        direct(eng, values, stage)
        a = safe_get_full_optimizer_state(probe, "exp_avg")
        public(eng, values, stage)
        b = safe_get_full_optimizer_state(probe, "exp_avg")
        print(
            f"ZeRO-{stage}: public setters {theirs:.1f} ms, direct copies {ours:.1f} ms, "
            f"same values: {torch.equal(a, b)}"
        )


if __name__ == "__main__":
    main()
