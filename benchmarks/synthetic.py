"""torchrun worker for the benchmarks: save a synthetic LM with Adam state, or time a load.

    save --params-m 300 --zero 1 --out DIR   one training step, then save with ucp_deepspeed; also
                                             time a plain DeepSpeed save of the same engine
    save ... --tp 2                          the same model built from megatron-core's column- and
                                             row-parallel linears and vocab-parallel embedding
    save ... --ep 2                          DeepSpeed MoE blocks of 4 experts, 2 expert-parallel ranks
    load --params-m 300 --zero 2 --source DIR  time engine.load_checkpoint (native or resharded); with
                                             --plain, DeepSpeed's own load without our checks; --direct,
                                             ours straight from the rank files; --deepspeed-universal TAG,
                                             DeepSpeed's load_universal of a ds_to_universal folder; --step,
                                             also time the first training step; --each 'ARGS' adds
                                             another load to the launch
    async --params-m 75 --out DIR            side by side on the same engine and state: the stall of each
                                             save (the save call plus --steps steps after it, less as many
                                             plain steps), its time to durable, extra memory and bytes,
                                             for ours sync, ours async (writer process with staging made
                                             once; and the writer thread it replaced), DeepSpeed's own
                                             save, and DCP's async_save (thread, process, process with
                                             its cached shared-memory staging); ZeRO-1/2
    stall --params-m 75 --out DIR|URL        a synchronous save to DIR/sync (kept, for loads) and an
                                             asynchronous one to DIR/async: the stall of each, the
                                             background rest, the objects and bytes written; on disk or
                                             an object store alike

Rank 0 prints one JSON line starting with `RESULT `.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import shlex
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import deepspeed
import psutil
import torch
import torch.distributed as dist
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from s3floor import SERVER_PID

import ucp_deepspeed
from ucp_deepspeed.io import stats
from ucp_deepspeed.io import storage as st
from ucp_deepspeed.runtime.async_save import AsyncCheckpointEngine
from ucp_deepspeed.runtime.native_io import rebind, unbound
from ucp_deepspeed.runtime.write_worker import bind_threads

HIDDEN = 1024
VOCAB = 32768
EXPERTS = 4


class SyntheticLM(torch.nn.Module):
    """An embedding and residual MLP blocks: parameter sizes like a small GPT's, no attention needed."""

    def __init__(self, layers: int, hidden: int, vocab: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)
            )
            for _ in range(layers)
        )
        self.norm = torch.nn.LayerNorm(hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.norm(x).pow(2).mean()


class TensorParallelLM(torch.nn.Module):
    """SyntheticLM split across tensor-parallel ranks with megatron-core layers (the norm stays replicated)."""

    def __init__(self, layers: int, hidden: int, vocab: int) -> None:
        super().__init__()
        from megatron.core import ModelParallelConfig
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

        config = ModelParallelConfig(
            tensor_model_parallel_size=2, use_cpu_initialization=True, gradient_accumulation_fusion=False
        )
        init = torch.nn.init.xavier_normal_
        self.embed = VocabParallelEmbedding(vocab, hidden, init_method=init, config=config)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleList(
                [
                    ColumnParallelLinear(
                        hidden, 4 * hidden, config=config, init_method=init, gather_output=False, bias=True
                    ),
                    RowParallelLinear(
                        4 * hidden,
                        hidden,
                        config=config,
                        init_method=init,
                        bias=True,
                        input_is_parallel=True,
                        skip_bias_add=False,
                    ),
                ]
            )
            for _ in range(layers)
        )
        self.norm = torch.nn.LayerNorm(hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for fc1, fc2 in self.blocks:
            x = x + fc2(torch.nn.functional.gelu(fc1(x)[0]))[0]
        return self.norm(x).pow(2).mean()


class MoELM(torch.nn.Module):
    """SyntheticLM with each MLP block replaced by a DeepSpeed MoE layer of 4 such blocks (top-1)."""

    def __init__(self, layers: int, hidden: int, vocab: int, ep: int) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(
            MoE(
                hidden_size=hidden,
                expert=torch.nn.Sequential(
                    torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)
                ),
                num_experts=EXPERTS,
                ep_size=ep,
                k=1,
                drop_tokens=False,
                use_rts=False,
            )
            for _ in range(layers)
        )
        self.norm = torch.nn.LayerNorm(hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)[0]
        return self.norm(x).pow(2).mean()


class Block(torch.nn.Sequential):
    """SyntheticLM's residual MLP block, as a pipeline layer."""

    def __init__(self, hidden: int) -> None:
        super().__init__(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + super().forward(x)


def pipeline_lm(layers: int, hidden: int, vocab: int, stages: int) -> torch.nn.Module:
    """SyntheticLM as a DeepSpeed PipelineModule, with the embedding tied to an output head on the last stage
    (as Megatron-DeepSpeed's GPTModelPipe)."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    def head(embed: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, embed.weight)

    specs = [
        TiedLayerSpec("embed", torch.nn.Embedding, vocab, hidden),
        *[LayerSpec(Block, hidden) for _ in range(layers)],
        LayerSpec(torch.nn.LayerNorm, hidden),
        TiedLayerSpec("embed", torch.nn.Embedding, vocab, hidden, forward_fn=head),
    ]
    return PipelineModule(specs, num_stages=stages, loss_fn=lambda logits, _: logits.pow(2).mean())


def shape_for(params_m: float, experts: int = 1) -> tuple[int, int, int]:
    """(layers, hidden, vocab) giving about `params_m` million parameters (tiny sizes shrink everything)."""
    hidden, vocab = (HIDDEN, VOCAB) if params_m >= 20 else (64, 512)
    per_block = experts * (8 * hidden * hidden + 5 * hidden)
    return max(1, round((params_m * 1e6 - vocab * hidden) / per_block)), hidden, vocab


def build(args: argparse.Namespace) -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(0)
    layers, hidden, vocab = shape_for(args.params_m, EXPERTS if args.ep else 1)
    dp = dist.get_world_size() // (args.tp * args.pp)
    config = {
        "train_batch_size": dp,
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": args.zero,
            "reduce_bucket_size": 10**7,
            # ZeRO-3 on 4 CPU ranks of one machine: keep few gathered parameters alive
            "stage3_max_live_parameters": 10**7,
            "stage3_prefetch_bucket_size": 10**7,
            # the optimizer steps one sub-group at a time: its temporaries stay this size, not the partition's
            "sub_group_size": 10**8,
        },
        "checkpoint": {
            "universal": {
                "enabled": True,
                "progress": False,
                "verify": bool(args.verify),
                "direct": bool(getattr(args, "direct", False)),
                "refresh": getattr(args, "refresh", "auto"),
                "layout_rules": [{"match": r"norm\..*", "layout": "replicated"}],
                "key_prefixes": getattr(args, "key_prefixes", 0),
            }
        },
    }
    # ZeRO-3: partition at construction, 4 full copies do not fit (Init parses the config even when disabled)
    with deepspeed.zero.Init(config_dict_or_path=config) if args.zero == 3 else contextlib.nullcontext():
        if args.ep:
            model = MoELM(layers, hidden, vocab, args.ep)
        elif args.pp > 1:
            model = pipeline_lm(layers, hidden, vocab, args.pp)
        else:
            model = (TensorParallelLM if args.tp > 1 else SyntheticLM)(layers, hidden, vocab)
    groups = [{"params": list(model.parameters()), "name": "all"}]
    if args.ep:  # experts are partitioned over their expert-data-parallel group
        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    optimizer = torch.optim.AdamW(groups, lr=1e-4)
    if getattr(args, "deepspeed_universal", None):  # DeepSpeed alone, as its own universal checkpoint is used
        config["checkpoint"] = {"load_universal": True}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        return engine
    engine, _, _, _ = ucp_deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def training_step(engine: deepspeed.DeepSpeedEngine, params_m: float) -> Callable[[], None]:
    """One training step on fixed tokens (the same on every tensor-parallel rank)."""
    torch.manual_seed(1)
    tokens = torch.randint(0, shape_for(params_m)[2], (1, 16))

    def step() -> None:
        if isinstance(engine, deepspeed.PipelineEngine):
            engine.train_batch(iter([(tokens, tokens)]))
            return
        engine.backward(engine(tokens))
        engine.step()

    return step


class Usage:
    """This rank's peak resident memory above its level at entry (and what of it is still held at exit), and the
    bytes it passed to write() and got from read(), over a block (bytes read through mmap are not counted;
    `sockets` is what the machine's interfaces received meanwhile, to tell the ranks' messages from file IO);
    `from_disk` is what of it the kernel had to fetch from the disk, not the page cache: a load measured warm and
    one that found its source evicted differ there."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.extra_rss = self.held_rss = self.written = self.read = self.sockets = self.from_disk = 0
        self.cpu_s = 0.0
        self._done = threading.Event()

    def __enter__(self) -> Usage:
        self._base = self.process.memory_info().rss
        io = self.process.io_counters()
        self._written, self._read, self._disk = io.write_chars, io.read_chars, io.read_bytes
        self._sockets = socket_bytes()
        self._cpu = sum(self.process.cpu_times()[:2])
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.02):
            self.extra_rss = max(self.extra_rss, self.process.memory_info().rss - self._base)

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.held_rss = self.process.memory_info().rss - self._base
        self.extra_rss = max(self.extra_rss, self.held_rss)
        io = self.process.io_counters()
        self.written, self.read = io.write_chars - self._written, io.read_chars - self._read
        self.from_disk = io.read_bytes - self._disk
        self.sockets = socket_bytes() - self._sockets
        self.cpu_s = sum(self.process.cpu_times()[:2]) - self._cpu


def gathered_ints(value: int) -> list[int]:
    """Every rank's `value`."""
    box = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(box, torch.tensor([value], dtype=torch.int64))
    return [int(b) for b in box]


def socket_bytes() -> int:
    """Bytes the machine's network interfaces have received (the ranks of one machine talk over loopback)."""
    with open("/proc/net/dev") as f:
        return sum(int(line.split(":", 1)[1].split()[0]) for line in f if ":" in line)


def summed(*values: float) -> list[float]:
    """Each value summed over the ranks."""
    box = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(box)
    return box.tolist()


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _known_kinds(value: str) -> str:
    """`--kinds`, refused at once if it names a kind that does not exist or leaves out a term of the ratio."""
    unknown = [k for k in value.split(",") if k not in KINDS]
    if unknown or not {"sync", "async"} <= set(value.split(",")):
        raise argparse.ArgumentTypeError(f"unknown {unknown}, or not both sync and async (the ratio's terms)")
    return value


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load", "async", "stall"])
    parser.add_argument("--params-m", type=float, required=True)
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--out")
    parser.add_argument("--source")
    parser.add_argument("--verify", type=int, default=1, help="check every byte a load reads against its CRC")
    parser.add_argument(
        "--plain", action="store_true", help="load: DeepSpeed's own load, without ucp_deepspeed's checks"
    )
    parser.add_argument("--direct", action="store_true", help="load: reshard straight from the rank files")
    parser.add_argument("--deepspeed-universal", metavar="TAG", help="load: DeepSpeed's load_universal of TAG")
    parser.add_argument("--step", action="store_true", help="load: also time the first training step after it")
    parser.add_argument(
        "--refresh", default="auto", choices=["auto", "read", "gather"], help='load: the "refresh" option'
    )
    parser.add_argument("--key-prefixes", type=int, default=0, help='save: the "key_prefixes" option (on a store)')
    parser.add_argument("--steps", type=int, default=4, help="async: training steps after each save in its stall")
    parser.add_argument("--repeat", type=int, default=3, help="save: timed saves of each kind before the kept one")
    parser.add_argument("--kinds", type=_known_kinds, help=f"async: only these kinds of save ({', '.join(KINDS)})")
    parser.add_argument("--tp", type=int, default=1, choices=[1, 2])
    parser.add_argument("--pp", type=int, default=1, help="a DeepSpeed PipelineModule of this many stages")
    parser.add_argument(
        "--ep", type=int, default=0, help="DeepSpeed MoE blocks (4 experts) at this expert-parallel size"
    )
    parser.add_argument(
        "--each",
        action="append",
        default=[],
        metavar="'ARGS'",
        help="save or load: one more in the same launch, given as its own quoted arguments (a fresh engine)",
    )
    args = parser.parse_args()
    runs = [args] + [parser.parse_args(shlex.split(more)) for more in args.each]
    if args.each and any(
        run.mode != args.mode or run.mode not in ("save", "load") or run.tp != args.tp or (run.each and run is not args)
        for run in runs
    ):
        parser.error("--each adds saves or loads like the first run's, at its --tp, and cannot nest")
    deepspeed.init_distributed(dist_backend="gloo")
    if args.tp > 1:
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    results = []
    for run in runs:
        if run.mode == "load":
            results.append(load(run))
        elif run.mode == "save":
            results.append(save(run))
        else:
            engine = build(run)
            step = training_step(engine, run.params_m)
            step()
            if run.mode == "async":
                only = run.kinds.split(",") if run.kinds else ()
                results.append(save_stalls(engine, step, run.out, run.steps, run.repeat, only))
            else:
                results.append(stalls(engine, step, run.out))
        gc.collect()  # one engine's state at a time, at any size
    if dist.get_rank() == 0:
        for one in results:
            print("RESULT " + json.dumps(one), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def save(args: argparse.Namespace) -> dict:
    """One training step, then the kept save into `--out`, after `--repeat` timed plain and ucp saves of each kind
    (into fresh folders, alternating; the best of each)."""
    engine = build(args)
    training_step(engine, args.params_m)()
    trial = os.path.join(args.out, "trial")
    plain_s, ucp_s = [], []
    for _ in range(args.repeat):
        plain_s.append(timed(lambda: deepspeed.DeepSpeedEngine.save_checkpoint(engine, trial)))
        if dist.get_rank() == 0:
            shutil.rmtree(trial)
        ucp_s.append(timed(lambda: engine.save_checkpoint(trial)))
        if dist.get_rank() == 0:
            shutil.rmtree(trial)
    engine.save_checkpoint(args.out)
    experts = EXPERTS if args.ep else 1
    layers, hidden, vocab = shape_for(args.params_m, experts)
    gates = EXPERTS * hidden if args.ep else 0
    engine.destroy()
    return {
        "plain_save_s": min(plain_s, default=0.0),
        "ucp_save_s": min(ucp_s, default=0.0),
        "params": vocab * hidden + layers * (experts * (8 * hidden * hidden + 5 * hidden) + gates) + 2 * hidden,
    }


def dcp_state(engine: deepspeed.DeepSpeedEngine) -> dict:
    """The state DeepSpeed's files hold, as DCP saves it: the module's weights (replicated, written once) and this
    rank's fp32 partitions with their Adam states (keyed by rank: DCP writes a plain tensor once, from rank 0)."""
    opt, rank = engine.optimizer, dist.get_rank()
    state: dict = {"model": dict(engine.module.state_dict())}  # at ZeRO-3 only placeholders, as DeepSpeed's file
    flats = getattr(opt, "single_partition_of_fp32_groups", None) or opt.fp32_partitioned_groups_flat
    for i, flat in enumerate(flats):
        state[f"rank{rank}.fp32.{i}"] = flat
        for key, value in opt.optimizer.state[flat].items():
            state[f"rank{rank}.optim.{i}.{key}"] = value
    return state


# `async --kinds`: the short name of each kind of save (a launch at a size where every kind's staging would not fit)
KINDS = {
    "sync": "ours, sync",
    "deepspeed": "DeepSpeed's own save",
    "deepspeed-python": "DeepSpeed's own save, python writer",
    "deepspeed-fast": "DeepSpeed's own save, fast writer (FastPersist)",
    "thread": "ours, async: writer thread (before)",
    "async": "ours, async: writer process, staging made once",
    "dcp-thread": "DCP async_save, thread",
    "dcp-process": "DCP async_save, process",
    "dcp-cached": "DCP async_save, process, cached staging",
    "bound-sync": "ours, sync, each rank bound to a core",
    "bound-async": "ours, async, each rank bound to a core, the writer on the others",
}


def save_stalls(
    engine: deepspeed.DeepSpeedEngine,
    step: Callable[[], None],
    out: str,
    steps: int,
    repeats: int,
    only: Sequence[str] = (),
) -> dict:
    """Each kind of save of the same engine, side by side: its stall (the save call plus `steps` steps after it, less
    `steps` plain steps timed right before it; the median of `repeats` warm saves, taken in turns with every other
    kind's), its time to durable (a save and its wait alone, the median of 3), the extra resident memory its first
    save left held (shared staging included) and the bytes it wrote, summed over the ranks. `only`: the kinds by
    short name (`KINDS`), all if empty; a kind not made is never staged."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    for _ in range(3):  # a ZeRO-3 engine's first steps record its prefetch trace and are seconds slower
        step()
    sync_engine = unbound(engine)

    writers: list[AsyncCheckpointEngine] = []  # every async kind's, alive until the last save of all

    def ours(inner: Any) -> tuple[Callable[[str], object], Callable[[object], None]]:
        if inner is not sync_engine:
            writers.append(inner)

        def save(d: str) -> None:
            rebind(engine, inner)
            engine.save_checkpoint(d)

        return save, lambda _: engine.wait_for_checkpoint()

    def deepspeed_own() -> tuple[Callable[[str], object], Callable[[object], None]]:
        def save(d: str) -> None:
            bound = engine.checkpoint_engine
            engine.checkpoint_engine = sync_engine  # DeepSpeed's own engine, without our binding
            try:
                deepspeed.DeepSpeedEngine.save_checkpoint(engine, d)
            finally:
                engine.checkpoint_engine = bound

        return save, lambda _: None

    def deepspeed_writer(kind: str) -> tuple[Callable[[str], object], Callable[[object], None]]:
        """DeepSpeed's own save through the writer `"checkpoint": {"writer": {"type": kind}}` makes (its default
        64 MiB buffer, every data-parallel rank a writer of the replicated files, as FastPersist splits them)."""
        from deepspeed.runtime.checkpoint_engine.utils import create_checkpoint_engine
        from deepspeed.runtime.model_checkpointing.config import get_checkpoint_writer_config
        from deepspeed.utils import groups

        if kind == "fast" and engine.device.type == "cpu":
            # tests/fastpersist_cpu.py: DeepSpeed pins its IO buffer, which needs an accelerator; nothing else
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
            import fastpersist_cpu

            fastpersist_cpu.enable()
        for key, value in {"CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": os.environ["LOCAL_WORLD_SIZE"]}.items():
            os.environ.setdefault(key, value)  # what the deepspeed launcher sets (one node); torchrun does not
        config = copy.copy(engine._config)
        writer_config = get_checkpoint_writer_config({"writer": {"type": kind, "data_parallel": "replica"}})
        config.checkpoint_config = {**engine._config.checkpoint_config, "writer": writer_config}
        stage = engine.zero_optimization_stage()
        writer = create_checkpoint_engine(config, groups, stage, engine.has_moe_layers, optimize_dp_state=stage < 3)
        # a writer of the replicated files, or a rank DeepSpeed has write its model states anyway (ZeRO-3's first group)
        writes_model = writer.is_data_parallel_writer(groups._get_sequence_data_parallel_rank())
        writes_model = writes_model or engine.save_non_zero_checkpoint

        def save(d: str) -> None:
            bound, flag = engine.checkpoint_engine, engine.save_non_zero_checkpoint
            engine.checkpoint_engine, engine.save_non_zero_checkpoint = writer, writes_model
            try:
                deepspeed.DeepSpeedEngine.save_checkpoint(engine, d)
            finally:
                engine.checkpoint_engine, engine.save_non_zero_checkpoint = bound, flag

        return save, lambda _: None

    # DCP's own group, as torchtitan gives it: its thread's collectives would otherwise interleave with the
    # training step's on one gloo group (a ZeRO-3 step's reduce-scatter hung against them)
    dcp_group = dist.new_group(backend="gloo")

    def dcp_save(kind: Any, stager: Any = None) -> tuple[Callable[[str], object], Callable[[object], None]]:
        def save(d: str) -> object:
            return dcp.async_save(
                dcp_state(engine),
                checkpoint_id=d,
                process_group=dcp_group,
                async_checkpointer_type=kind,
                async_stager=stager,
            )

        def wait(response: Any) -> None:
            getattr(response, "upload_completion", response).result()

        return save, wait

    cached = StagingOptions(
        use_pinned_memory=False, use_shared_memory=True, use_async_staging=False, use_non_blocking_copy=False
    )
    kinds: list[tuple[str, Callable[[], tuple[Callable[[str], object], Callable[[object], None]]]]] = [
        ("ours, sync", lambda: ours(sync_engine)),
        ("DeepSpeed's own save", deepspeed_own),
        ("DeepSpeed's own save, python writer", lambda: deepspeed_writer("python")),
        ("DeepSpeed's own save, fast writer (FastPersist)", lambda: deepspeed_writer("fast")),
        ("ours, async: writer thread (before)", lambda: ours(AsyncCheckpointEngine(engine._config, process=False))),
        (
            "ours, async: writer process, staging made once",
            lambda: ours(AsyncCheckpointEngine(engine._config, module=engine.module)),
        ),
        ("DCP async_save, thread", lambda: dcp_save(AsyncCheckpointerType.THREAD)),
        ("DCP async_save, process", lambda: dcp_save(AsyncCheckpointerType.PROCESS)),
        (
            "DCP async_save, process, cached staging",
            lambda: dcp_save(AsyncCheckpointerType.PROCESS, DefaultStager(cached)),
        ),
    ]
    # each rank bound to a core of its own, as `deepspeed --bind_cores_to_rank` binds them, and the writer on the
    # cores no rank trains on (`async_writer_cpus`): only where there are such cores
    everywhere = sorted(os.sched_getaffinity(0))
    spare = everywhere[dist.get_world_size() :]
    bound = [
        ("ours, sync, each rank bound to a core", lambda: ours(sync_engine)),
        (
            "ours, async, each rank bound to a core, the writer on the others",
            lambda: ours(AsyncCheckpointEngine(engine._config, module=engine.module, writer_cpus=spare)),
        ),
    ]
    pinned = {name for name, _ in bound} if spare else set()
    kinds += bound if spare else []
    if only:
        kinds = [(name, make) for name, make in kinds if name in {KINDS[k] for k in only}]

    def place(name: str) -> None:
        """Every thread of this rank on its own core for a bound kind, else on all of them."""
        bind_threads({everywhere[dist.get_rank()]} if name in pinned else set(everywhere))

    def stall(name: str, target: str) -> float:
        """One save of kind `name` and the steps after it, less as many plain steps timed right before it."""
        save, wait = made[name]
        place(name)
        plain = timed(lambda: [step() for _ in range(steps)])
        os.sync()  # the last save's dirty pages, which the kernel would write back during this one
        box: list = []
        seconds = timed(lambda: (box.append(save(target)), [step() for _ in range(steps)])) - plain
        wait(box[0])
        dist.barrier()
        return seconds

    def clear() -> None:
        if dist.get_rank() == 0:
            for d in os.listdir(out):
                shutil.rmtree(os.path.join(out, d), ignore_errors=True)
        dist.barrier()

    # each kind's first save (it makes the kind's staging and writer: what it leaves held is measured here), then the
    # warm saves in turns, every kind once per turn: this host drifts by seconds within a launch, and a kind measured
    # in a block of its own reads that drift as its own (a synchronous save read 0.93 s and 3.54 s in one launch)
    made: dict[str, tuple[Callable[[str], object], Callable[[object], None]]] = {}
    first, held, warm = {}, {}, {name: [] for name, _ in kinds}
    for name, make in kinds:
        rss = psutil.Process().memory_info().rss
        made[name] = make()
        first[name] = stall(name, os.path.join(out, f"{len(made)}-first"))
        held[name] = summed(psutil.Process().memory_info().rss - rss)[0]
        clear()
    for turn in range(repeats):
        for i, (name, _) in enumerate(kinds):
            warm[name].append(stall(name, os.path.join(out, f"{i}-{turn}")))
        clear()
    rows = []
    for i, (name, _) in enumerate(kinds):
        save, wait = made[name]
        place(name)
        durables = []
        for j in range(3):  # the page cache makes one save's time swing by seconds here: the median of 3
            target = os.path.join(out, f"{i}-durable-{j}")
            os.sync()
            durables.append(timed(lambda: wait(save(target))))  # noqa: B023  (called here, at once)
        tree = os.walk(target) if dist.get_rank() == 0 else []
        written = summed(sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in tree for f in fs))[0]
        rows.append(
            {
                "kind": name,
                "stall_s": statistics.median(warm[name]),
                "stalls_s": warm[name],
                "first_stall_s": first[name],
                "durable_s": statistics.median(durables),
                "held_gb": held[name] / 1e9,
                "bytes": written,
            }
        )
        clear()
    rebind(engine, sync_engine)
    for writer in writers:
        writer.cleanup()
    place("")  # unbound again, for the floor and for the next launch's kinds
    floor = statistics.median(disk_floor(out, rows[0]["bytes"]) for _ in range(3))
    return {"steps": steps, "floor_s": floor, "rows": rows}


def disk_floor(out: str, nbytes: float) -> float:
    """The disk's time to durable for `nbytes`, shared over the ranks: each writes its share from memory in 64 MiB
    writes, fsyncs it and its folder (the slowest rank's time, after an `os.sync()`)."""
    share = int(nbytes) // dist.get_world_size()
    chunk = torch.randint(0, 256, (min(share, 64 << 20),), dtype=torch.uint8).numpy()
    path = os.path.join(out, f"floor-{dist.get_rank()}")
    os.sync()
    dist.barrier()

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            for start in range(0, share, len(chunk)):
                os.write(fd, chunk[: share - start])
            os.fsync(fd)
        finally:
            os.close(fd)
        folder = os.open(out, os.O_RDONLY)
        os.fsync(folder)
        os.close(folder)
        dist.barrier()

    seconds = timed(write)
    os.unlink(path)
    return seconds


def stalls(engine: deepspeed.DeepSpeedEngine, step: Callable[[], None], out: str) -> dict:
    """How long a synchronous and an asynchronous save to `out` (a folder or an object-store URL) keep training
    waiting, what the asynchronous one leaves to the background, and what each wrote."""
    sync_dir, async_dir = st.join(out, "sync"), st.join(out, "async")
    result = {"step_s": min(timed(step) for _ in range(2))}
    result["sync_save_s"] = timed(lambda: engine.save_checkpoint(sync_dir))
    rebind(engine, AsyncCheckpointEngine(engine._config))
    result["async_stall_s"] = timed(lambda: engine.save_checkpoint(async_dir))
    result["step_while_writing_s"] = timed(step)
    result["async_rest_s"] = timed(engine.wait_for_checkpoint)
    if dist.get_rank() == 0:
        tag = st.join(sync_dir, st.read_text(st.join(sync_dir, "latest")))
        found = st.find(tag)
        result["objects"], result["bytes"] = len(found), sum(st.stat(st.join(tag, rel))[0] for rel in found)
    return result


def load(args: argparse.Namespace) -> dict:
    """Time one load into a fresh engine (ours; with --plain or --deepspeed-universal DeepSpeed's own), and what it
    cost: the extra resident memory and the bytes written, each summed over the ranks."""
    engine = build(args)
    if args.plain:  # DeepSpeed's own load with none of our checks: what they cost is measured against it
        engine.checkpoint_engine = unbound(engine)  # DeepSpeed's own engine, without our binding
        run, mode = lambda: deepspeed.DeepSpeedEngine.load_checkpoint(engine, args.source), "plain"
    elif args.deepspeed_universal:
        run, mode = lambda: engine.load_checkpoint(args.source, tag=args.deepspeed_universal), "deepspeed-universal"
    else:
        run, mode = lambda: engine.load_checkpoint(args.source), None
    # the store's client (s3fs, its HTTP session) is made before the timing, as DCP's readers are made before dcp.load
    st.storage_of(args.source)
    # the store's server, whose CPU the ranks share, only for a load from it: a local load's window would count what
    # the idle server did meanwhile (0.01 s once, a row the smoke test then read as a store's)
    from_store = os.environ.get(SERVER_PID) and st.is_url(args.source)
    server = psutil.Process(int(os.environ[SERVER_PID])) if from_store else None
    try:
        server_cpu = sum(server.cpu_times()[:2]) if server else 0.0
        with Usage() as usage, stats.counting() as counted:
            seconds = timed(run)
        server_cpu = sum(server.cpu_times()[:2]) - server_cpu if server else 0.0
    except Exception as exc:  # recorded: a load DeepSpeed cannot do raises alike on every rank, and is a result
        engine.destroy()
        return {"error": f"{type(exc).__name__}: {exc}"[:300], "mode": mode}
    extra_rss, held_rss, written, read = summed(usage.extra_rss, usage.held_rss, usage.written, usage.read)
    # gloo moves bytes through sockets with write() and read(); what the ranks sent each other is not file IO
    sent = usage.sockets if dist.get_rank() == 0 else 0.0
    written, read = max(0.0, written - sent), max(0.0, read - sent)
    # held: what the engine keeps (the optimizer states a load creates); the rest of the peak was the load's own
    result = {
        "load_s": seconds,
        "mode": mode or engine.ucp_last_load.mode,
        "extra_rss": extra_rss,
        "held_rss": held_rss,
    }
    result.update(written=written, read=read, from_disk=summed(usage.from_disk)[0])
    # CPU seconds of every thread, summed over the ranks: on a machine that also runs the store, they share its cores
    result["cpu_s"] = summed(usage.cpu_s)[0]
    if server is not None:  # every rank timed the same window
        result["server_cpu_s"] = server_cpu
    # what every rank asked of storage: requests (ranged GETs on a store, preads on disk) and bytes fetched
    result["requests"], result["fetched"], result["copied"] = summed(
        counted.requests, counted.data_bytes + counted.metadata_bytes, counted.copied_bytes
    )
    result["max_rank_requests"] = max(gathered_ints(counted.requests))
    # round trips before and between the reads: HEADs and listings on a store
    result["lookups"] = summed(counted.lookups)[0]
    result["max_rank_round_trips"] = max(gathered_ints(counted.requests + counted.lookups))
    if mode is None:
        result["kind"] = engine.ucp_last_load.kind
        result["in_place"] = engine.ucp_last_load.in_place
    if args.step:
        result["step_s"] = timed(training_step(engine, args.params_m))
    engine.destroy()
    return result


if __name__ == "__main__":
    main()
