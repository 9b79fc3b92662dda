"""A PyTorch Lightning job on DeepSpeed (`DeepSpeedStrategy`) with ucp_deepspeed installed: an ordinary Lightning
script but for `ucp_deepspeed.install()` at the top, a strategy subclass that lifts Lightning's refusal of a CPU
accelerator (the one check that names CUDA), and the probes the tests read.

    fit     --out DIR --zero Z [--resume CKPT] [--async-save] [--top-k K] [--save-last] [--ckpt-dir D] [--die-in-save N]
    predict --out DIR --zero Z --ckpt CKPT     validate, test and predict from CKPT (an engine without an optimizer)

`--each 'ARGS'` runs one more in the same launch, after this one.

A tiny next-token model over 16 tokens: 8 steps of a global batch of 6 (2 epochs; Lightning restarts an epoch its
loader cannot skip into, so a save ends one), a ModelCheckpoint every 4 steps. Probes, by
rank 0 into DIR: the model's full fp32 weights and Adam states at each save (`saved_step<K>.pt`) and when a resumed
fit starts (`resumed_step<K>.pt`), `losses.json` (the loss of each step, the load, Lightning's own state after the
resume: epoch, global step, the fit loop's progress and the checkpoint callback's), and `evaluated.json`.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal

import common  # tests/workers/common.py, next to this script: `--each`, and launch/ on sys.path
import deepspeed
import lightning.pytorch as pl
import torch
import torch.distributed as dist
import train_hf  # launch/train_hf.py: its snapshot of a DeepSpeed engine's fp32 weights and Adam states
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DeepSpeedStrategy

import ucp_deepspeed

GLOBAL_BATCH = 6
VOCAB = 16


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeed strategy on the CPU (test-only): its `setup_environment` refuses any accelerator but
    CUDA by name; nothing else of it needs CUDA here."""

    def setup_environment(self) -> None:
        super(DeepSpeedStrategy, self).setup_environment()


class Tokens(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.hidden = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.out = torch.nn.Linear(32, VOCAB)
        self.losses: dict[int, float] = {}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.nn.functional.gelu(self.hidden(self.embed(tokens)))))

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        loss = self._loss(batch)
        mean = self.all_gather(loss.detach()).mean().item()
        self.losses[self.global_step + 1] = mean
        self.log("progress", float(self.global_step), sync_dist=True)  # every later save scores better (top-k)
        return loss

    def validation_step(self, batch: torch.Tensor, index: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: torch.Tensor, index: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        return self(batch[:, :-1]).argmax(-1)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH * 4, 9), generator=g)  # an epoch of 4 steps: saves end epochs
    per_device = GLOBAL_BATCH // int(os.environ.get("WORLD_SIZE", "1"))
    return torch.utils.data.DataLoader(tokens, batch_size=per_device, shuffle=False)


class Probe(pl.Callback):
    """Snapshots of the engine at each save and when a resumed fit starts (collective: every rank takes them)."""

    def __init__(self, out: str, resumed: bool) -> None:
        self.out, self.resumed = out, resumed

    def on_save_checkpoint(self, trainer, module, checkpoint):  # type: ignore[no-untyped-def]
        snap = train_hf.snapshot(trainer.strategy.deepspeed_engine)
        train_hf.save_probe(self.out, f"saved_step{trainer.global_step}.pt", snap)

    def on_train_start(self, trainer, module):  # type: ignore[no-untyped-def]
        if self.resumed:
            snap = train_hf.snapshot(trainer.strategy.deepspeed_engine)
            train_hf.save_probe(self.out, f"resumed_step{trainer.global_step}.pt", snap)


def trainer(args: argparse.Namespace, callbacks: list) -> pl.Trainer:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.zero},
        # Lightning's engine for validate, test and predict at ZeRO-3 reads this key of a config given to it (its own
        # default config sets it); without it, a KeyError in Lightning
        "zero_allow_untested_optimizer": True,
        "checkpoint": {"universal": {"enabled": True, "progress": False, "async_save": args.async_save}},
    }
    # the CPU devices given to the strategy, beside the subclass: Lightning otherwise finds no device index per rank
    strategy = CPUDeepSpeedStrategy(
        config=config, parallel_devices=[torch.device("cpu", i) for i in range(world)], process_group_backend="gloo"
    )
    return pl.Trainer(
        strategy=strategy,
        devices=world,
        max_steps=8,
        callbacks=callbacks,
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
        default_root_dir=args.out,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )


def die_while_saving_last(count: int) -> None:
    """Test hook: the last rank writes half of its optimizer file of the `count`-th save into `last.ckpt`, then is
    SIGKILLed (Lightning saves `last.ckpt` again at each save, always as tag "checkpoint")."""
    import torch.distributed as dist
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    original, seen = TorchCheckpointEngine.save, []

    def save(self: TorchCheckpointEngine, state_dict: dict, path: str) -> None:
        if "last.ckpt" in str(path) and "optim_states" in str(path) and dist.get_rank() == dist.get_world_size() - 1:
            seen.append(path)
            if len(seen) == count:
                buf = io.BytesIO()
                torch.save(state_dict, buf)
                with open(path, "wb") as f:
                    f.write(buf.getbuffer()[: buf.tell() // 2])
                os.kill(os.getpid(), signal.SIGKILL)
        original(self, state_dict, path)

    TorchCheckpointEngine.save = save  # type: ignore[method-assign]


def do_fit(args: argparse.Namespace) -> None:
    if args.die_in_save:
        die_while_saving_last(args.die_in_save)
    monitor = {"monitor": "progress", "mode": "max"} if args.top_k != -1 else {}
    saves = ModelCheckpoint(
        dirpath=args.ckpt_dir or os.path.join(args.out, "ckpt"),
        filename="step{step}",
        every_n_train_steps=4,
        save_top_k=args.top_k,
        save_last=args.save_last,
        auto_insert_metric_name=False,
        **monitor,
    )
    module = Tokens()
    run = trainer(args, [saves, Probe(args.out, bool(args.resume))])
    run.fit(module, data(), ckpt_path=args.resume)
    if run.global_rank == 0:
        engine = run.strategy.deepspeed_engine
        report = getattr(engine, "ucp_last_load", None)
        state = {
            "losses": module.losses,
            "global_step": run.global_step,
            "world": run.world_size,
            "load": None if report is None else {"mode": report.mode, "saved": report.saved, "live": report.live},
            "lightning": {
                "epoch": run.current_epoch,
                "batches_that_stepped": run.fit_loop.epoch_loop._batches_that_stepped,
                "checkpoint_best": os.path.basename(saves.best_model_path),
                "checkpoint_kept": sorted(os.path.basename(p) for p in saves.best_k_models),
            },
        }
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump(state, f)


def do_predict(args: argparse.Namespace) -> None:
    """validate, test and predict from a checkpoint: Lightning builds a DeepSpeed engine without an optimizer, which
    loads the checkpoint's weights (saved at any size)."""
    module = Tokens()
    run = trainer(args, [])
    run.limit_val_batches = 1.0
    validated = run.validate(module, data(), ckpt_path=args.ckpt)
    tested = run.test(module, data(), ckpt_path=args.ckpt)
    predicted = run.predict(module, data(), ckpt_path=args.ckpt)
    counts: list = [None] * dist.get_world_size()  # each rank predicts its share of the batches
    dist.all_gather_object(counts, sum(p.numel() for p in predicted))
    with deepspeed.zero.GatheredParameters(list(module.parameters())):  # whole at ZeRO-3 (collective)
        weights = {n: p.detach().float().tolist() for n, p in module.named_parameters()}
    if run.global_rank == 0:
        out = {
            "val_loss": validated[0]["val_loss"],
            "test_loss": tested[0]["test_loss"],
            "predicted": sum(counts),
            "weights": weights,
        }
        with open(os.path.join(args.out, "evaluated.json"), "w") as f:
            json.dump(out, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["fit", "predict"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--zero", type=int, default=2)
    parser.add_argument("--resume", help="fit: a checkpoint of this job to resume from (ckpt_path)")
    parser.add_argument("--ckpt", help="predict: the checkpoint to validate, test and predict from")
    parser.add_argument("--async-save", action="store_true", help='fit: "async_save": true')
    parser.add_argument("--top-k", type=int, default=-1, help="fit: ModelCheckpoint's save_top_k (-1 keeps all)")
    parser.add_argument("--save-last", action="store_true", help="fit: ModelCheckpoint(save_last=True)")
    parser.add_argument("--ckpt-dir", help="fit: the ModelCheckpoint folder (DIR/ckpt)")
    parser.add_argument("--die-in-save", type=int, default=0, help="fit: the last rank dies in this save of last.ckpt")
    common.add_each(parser)
    ucp_deepspeed.install()
    for args in common.runs(parser):  # one Lightning Trainer after another, as a script that fits then tests
        os.makedirs(args.out, exist_ok=True)
        {"fit": do_fit, "predict": do_predict}[args.mode](args)


if __name__ == "__main__":
    main()
