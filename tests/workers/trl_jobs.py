"""TRL's preference and RL trainers on DeepSpeed with ucp_deepspeed installed: an ordinary TRL script but for
`ucp_deepspeed.install()` at the top and the probes the tests read.

    dpo  --out DIR --zero Z [--resume CHECKPOINT] [--init-from SFT_CKPT]
    grpo --out DIR --zero Z [--resume CHECKPOINT]
    sft  --out DIR --zero Z        an SFT run whose checkpoint a DPO job starts from (--init-from)

A tiny GPT-2 built from a config (saved to DIR/base, where TRL builds its reference model from) with a
character-level tokenizer made here; DPO trains on 48 (prompt, chosen, rejected) triples, GRPO on 48 prompts with a
reward for the letter `a`, generating with transformers. The global batch is 6 at every world size. TRL builds the
reference model (`beta` > 0) as a DeepSpeed engine without an optimizer (ZeRO-0, or ZeRO-3 at ZeRO-3).

Probes, by rank 0 into DIR: `losses.json`, the policy's full fp32 weights and Adam states at each save
(`saved_step<K>.pt`) and right after a resume (`resumed_step<K>.pt`), and the reference model's weights when training
begins (`reference_begin.pt`).
"""

from __future__ import annotations

import argparse
import json
import os

import common  # noqa: F401  (tests/workers/common.py, next to this script: puts launch/ on sys.path)
import torch
import train_hf  # launch/train_hf.py: the Trainer job's DeepSpeed config, CPU state and snapshots

GLOBAL_BATCH = 6
LETTERS = "abcdefghij"
SAMPLES = 48


def tokenizer():  # type: ignore[no-untyped-def]
    """One token per letter, and the specials TRL needs (no hub)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", " ", *LETTERS])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def base_model(out: str) -> str:
    """A tiny GPT-2 from a config, saved once where TRL builds its reference model from; its path."""
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    path = os.path.join(out, "base")
    # every rank takes rank 0's answer: a rank that looked after rank 0 wrote the file skipped the barrier below
    saved = [os.path.isfile(os.path.join(path, "config.json"))]
    if dist.is_initialized():
        dist.broadcast_object_list(saved, src=0)
    if not saved[0]:
        torch.manual_seed(1234)
        config = GPT2Config(vocab_size=16, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0)
        config.embd_pdrop = config.attn_pdrop = 0.0
        config.pad_token_id, config.eos_token_id = 0, 1
        model = GPT2LMHeadModel(config)
        if int(os.environ.get("RANK", "0")) == 0:
            model.save_pretrained(path)
            tokenizer().save_pretrained(path)
        if dist.is_initialized():
            dist.barrier()
    return path


def _letters(g: torch.Generator, n: int) -> str:
    return "".join(LETTERS[int(i)] for i in torch.randint(0, len(LETTERS), (n,), generator=g))


def preference_data():  # type: ignore[no-untyped-def]
    from datasets import Dataset

    g = torch.Generator().manual_seed(5)
    rows = [
        {"prompt": _letters(g, 3), "chosen": "a" + _letters(g, 2), "rejected": "j" + _letters(g, 2)}
        for _ in range(SAMPLES)
    ]
    return Dataset.from_list(rows)


def prompts():  # type: ignore[no-untyped-def]
    from datasets import Dataset

    g = torch.Generator().manual_seed(6)
    return Dataset.from_list([{"prompt": _letters(g, 3)} for _ in range(SAMPLES)])


def reward_a(completions: list[str], **_: object) -> list[float]:
    """GRPO's reward: how many `a`s a completion has."""
    return [float(c.count("a")) for c in completions]


def masters(engine) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The policy's full fp32 masters, before its optimizer has any state (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}


def reference_weights(engine) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The reference model's full weights, gathered under ZeRO-3 (collective)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def run(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    configured = train_hf.configure_cpu_state()  # the process group, before rank 0 writes the base model
    path = base_model(args.out)
    losses: dict[int, float] = {}

    class Probe(TrainerCallback):
        def on_log(self, targs, state, control, logs=None, **kw):  # type: ignore[no-untyped-def]
            if logs and "loss" in logs:
                losses[state.global_step] = logs["loss"]

        def on_save(self, targs, state, control, **kw):  # type: ignore[no-untyped-def]
            train_hf.save_probe(args.out, f"saved_step{state.global_step}.pt", train_hf.snapshot(trainer.model_wrapped))

        def on_train_begin(self, targs, state, control, **kw):  # type: ignore[no-untyped-def]
            if args.init_from:  # the policy starts from the SFT run's weights, saved at another size
                trainer.model_wrapped.load_checkpoint(args.init_from, load_module_only=True)
                train_hf.save_probe(args.out, "policy_begin.pt", masters(trainer.model_wrapped))
            if args.resume:
                train_hf.save_probe(
                    args.out, f"resumed_step{state.global_step}.pt", train_hf.snapshot(trainer.model_wrapped)
                )
            ref = getattr(trainer, "ref_model", None)
            if ref is not None:
                train_hf.save_probe(args.out, "reference_begin.pt", reference_weights(ref))

    common_args = {
        "output_dir": args.out,
        "per_device_train_batch_size": GLOBAL_BATCH // world,
        "max_steps": 8,
        "save_strategy": "steps",
        "save_steps": 4,
        "logging_steps": 1,
        "learning_rate": 1e-3,
        "lr_scheduler_type": "linear",
        "seed": 1234,
        "report_to": "none",
        "deepspeed": train_hf.ds_config(args.zero),
        "disable_tqdm": True,
        "save_only_model": False,
        "dataloader_num_workers": 0,
        "accelerator_config": {"use_configured_state": configured},
        "bf16": False,  # TRL's configs default to bf16
    }
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = tokenizer()
    if args.mode == "dpo":
        config = DPOConfig(**common_args, beta=0.1, max_length=16)
        trainer = DPOTrainer(model=model, args=config, train_dataset=preference_data(), processing_class=tok)
        if args.init_from:  # the reference model too: a DeepSpeed engine without an optimizer, loading weights
            trainer.ref_model.load_checkpoint(args.init_from)
    elif args.mode == "grpo":
        config = GRPOConfig(
            **common_args,
            beta=0.04,
            num_generations=2,
            max_completion_length=4,
            temperature=1.0,
            generation_batch_size=GLOBAL_BATCH,
        )
        trainer = GRPOTrainer(
            model=model, reward_funcs=[reward_a], args=config, train_dataset=prompts(), processing_class=tok
        )
    else:
        data = preference_data().map(
            lambda r: {"text": r["prompt"] + r["chosen"]}, remove_columns=["prompt", "chosen", "rejected"]
        )
        trainer = SFTTrainer(
            model=model, args=SFTConfig(**common_args, max_length=16), train_dataset=data, processing_class=tok
        )
    trainer.add_callback(Probe())
    trainer.train(resume_from_checkpoint=args.resume)
    import torch.distributed as dist

    if dist.get_rank() == 0:
        report = getattr(trainer.model_wrapped, "ucp_last_load", None)
        load = None if report is None else {"mode": report.mode, "saved": report.saved, "live": report.live}
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump({"losses": losses, "global_step": trainer.state.global_step, "world": world, "load": load}, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["dpo", "grpo", "sft"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--zero", type=int, default=2)
    parser.add_argument("--resume", help="a checkpoint folder of this job to resume from")
    parser.add_argument("--init-from", help="dpo: start the policy and the reference model from this checkpoint")
    args = parser.parse_args()
    import ucp_deepspeed

    ucp_deepspeed.install()
    os.makedirs(args.out, exist_ok=True)
    run(args)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
