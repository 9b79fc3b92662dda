"""DeepSpeed's AutoEP: a Hugging Face MoE model whose experts DeepSpeed stacks per expert-parallel rank resumes at
any AutoEP size, data-parallel size and ZeRO stage.

Tiny Mixtral and Qwen3-MoE models with 4 experts (`tests/workers/hf_parallel.py --arch`). Each target launch
compares every fp32 master, Adam moment, weight, step and hyperparameter with the saved run's using torch.equal,
every expert by its global id (each rank's stack placed where DeepSpeed's placement says), and the next 3 losses
with the uninterrupted run. DeepSpeed 0.19.8's AutoEP fails with the transformers `.ci/install` installs (5.23 and
later changed a registry it calls), so these launches put transformers 5.22.2 first on PYTHONPATH; `.ci/install`
installs it into `UCP_AUTOEP_TRANSFORMERS`.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT, OnDemand, load_results, torchrun

WORKER = ROOT / "tests" / "workers" / "hf_parallel.py"
OVERLAY = Path(os.environ.get("UCP_AUTOEP_TRANSFORMERS", ROOT / ".venv" / "overlays" / "transformers-5.22.2"))
LOSS_RTOL = 1e-4
TENSORS = {"mixtral": 92, "qwen3moe": 108}  # parameters x (fp32 master, weight, exp_avg, exp_avg_sq)

# launch -> (world size, runs: (architecture, variants, extra save flags))
SAVES = {
    "w4": (
        4,
        [
            ("mixtral", ("ep2z1",), ("--plain",)),  # plain DeepSpeed first: nothing of ucp has touched DeepSpeed yet
            ("mixtral", ("z1", "ep1z1", "ep2z1", "ep4z2", "ep2z3"), ()),
            ("qwen3moe", ("ep4z1",), ()),
        ],
    ),
    "w2": (2, [("mixtral", ("ep2z2",), ()), ("mixtral", ("ep2z1",), ("--plain",))]),
}


def _launch(world: int, runs: list[list[str]]) -> None:
    if not (OVERLAY / "transformers").is_dir():
        pytest.fail(f"{OVERLAY}: no transformers 5.22.2 for AutoEP; source .ci/install, which installs it there")
    argv = [*runs[0], *(a for rest in runs[1:] for a in ("--each", " ".join(rest)))]
    torchrun(world, *argv, worker=WORKER, timeout=600, paths=(OVERLAY,))


@pytest.fixture(scope="session")
def autoep_sources(tmp_path_factory: pytest.TempPathFactory) -> OnDemand:
    """`LAUNCH/ARCH/VARIANT` (`LAUNCH/plain/VARIANT` saved by plain DeepSpeed) after three steps."""
    out = tmp_path_factory.mktemp("autoep_sources")

    def folder(arch: str, flags: tuple[str, ...]) -> str:
        return "plain" if flags else arch

    def launch(name: str) -> None:
        world, runs = SAVES[name]
        _launch(
            world,
            [
                ["save", "--arch", arch, "--out", str(out / name / folder(arch, flags)), "--variant", *v, *flags]
                for arch, v, flags in runs
            ],
        )

    names = [f"{n}/{folder(arch, flags)}/{v}" for n, (_, runs) in SAVES.items() for arch, vs, flags in runs for v in vs]
    return OnDemand(out, names, lambda name: name.split("/")[0], launch)


def load(sources: OnDemand, tmp: Path, world: int, cases: dict[str, list], refuse: list = ()) -> list[dict]:
    """One launch at `world` ranks: Mixtral's `refuse` cases (each load must fail), then per architecture each
    (target, sources...) case; the results, in order."""
    runs, files = [], []
    for arch, pairs, flags in [("mixtral", refuse, ["--refuse"])] * bool(refuse) + [(*c, []) for c in cases.items()]:
        files.append(tmp / f"{arch}{'-refused' if flags else ''}.json")
        case_args = [a for target, names in pairs for a in ("--case", target, *(str(sources[n]) for n in names))]
        runs.append(["load", "--arch", arch, *flags, "--results", str(files[-1]), *case_args])
    _launch(world, runs)
    return [r for f in files for r in load_results(f)]


def check(results: list[dict], arch: str, expected: int) -> None:
    assert len(results) == expected
    for r in results:
        label = f"{arch}: {r['source']} -> {r['target']} at {r['world']} ranks ({r['how']})"
        assert r["how"].startswith("resharded"), label
        assert r["diffs"] == [], f"{label}: {r['diffs'][:8]}"
        assert r["tensors"] == TENSORS[arch], label
        assert r["max_rel_loss"] < LOSS_RTOL, f"{label}: {r['losses']} vs {r['reference_losses']}"


# One launch at 2 ranks loads the cases of the two tests below: first AutoEP turned on and off (AutoEP renames a MoE
# block, Hugging Face's fused `experts.gate_up_proj` being its `w1` over `w3`, and gives the experts a param group
# of their own), then resumes from 4 ranks at EP 2 and EP 1, every stage
ON_AND_OFF = [
    ("z1", ("w4/mixtral/ep2z1", "w4/mixtral/ep4z2")),  # AutoEP on -> off
    ("z3", ("w4/mixtral/ep2z3",)),
    ("ep2z2", ("w4/mixtral/z1",)),  # off -> on
    ("ep1z3", ("w4/mixtral/z1",)),
]
AT_TWO = [
    ("ep2z2", ("w4/mixtral/ep2z1", "w4/mixtral/ep4z2")),  # expert-DP 2 -> 1 at EP 2 (a rank's experts move)
    ("ep1z3", ("w4/mixtral/ep4z2", "w4/mixtral/ep2z3")),  # EP 4 -> 1 into ZeRO-3; ZeRO-3's expert partitions
    ("ep2z1", ("w4/mixtral/ep2z3",)),
]
# saved by plain DeepSpeed at EP 2 x expert-DP 2: the stacks placed off its own files (`ds_autoep_layers`)
PLAIN_AT_TWO = [("ep1z2", ("w4/plain/ep2z1",))]
QWEN_AT_TWO = [("ep2z3", ("w4/qwen3moe/ep4z1",)), ("ep1z2", ("w4/qwen3moe/ep4z1",))]


@pytest.fixture(scope="module")
def loaded_at_two(autoep_sources, tmp_path_factory) -> list[dict]:
    cases = {"mixtral": ON_AND_OFF + AT_TWO + PLAIN_AT_TWO, "qwen3moe": QWEN_AT_TWO}
    return load(autoep_sources, tmp_path_factory.mktemp("autoep_w2"), 2, cases)


def test_autoep_checkpoints_resume_at_any_ep_dp_and_stage(loaded_at_two):
    """Saved at 4 ranks (EP 2 x expert-DP 2, EP 4, EP 2 at ZeRO-3), resumed at 2: EP 2 and EP 1, every stage."""
    check(loaded_at_two[5:10], "mixtral", 5)
    check(loaded_at_two[11:], "qwen3moe", 2)


def test_a_plain_autoep_save_resumes_at_another_ep_size(loaded_at_two):
    """Saved by plain DeepSpeed at EP 2 x expert-DP 2 (no ucp metadata; it was refused): resumed at EP 1 on 2 ranks,
    each rank's stack placed by DeepSpeed's `ds_autoep_layers` and checked against its expert files."""
    check(loaded_at_two[10:11], "mixtral", 1)


def test_autoep_turns_on_and_off_at_a_resume(loaded_at_two):
    """A job without AutoEP resumes from an AutoEP save and the other way round. At AutoEP size 1 and the same DP
    size the topology is the same; DeepSpeed's own load would not find the names."""
    check(loaded_at_two[:5], "mixtral", 5)


@pytest.mark.slow  # the suite's budget; AutoEP resumes at 2 ranks stay in the default run
def test_autoep_resumes_at_a_world_its_experts_do_not_divide(autoep_sources, tmp_path):
    """4 experts cannot be spread over 3 ranks: EP 4 and EP 2 x expert-DP 2 resume at 3 ranks with AutoEP size 1."""
    cases = {"mixtral": [("ep1z1", ("w4/mixtral/ep4z2", "w4/mixtral/ep2z3")), ("ep1z3", ("w4/mixtral/ep2z1",))]}
    check(load(autoep_sources, tmp_path, 3, cases), "mixtral", 3)


@pytest.mark.parametrize("tp, sp", [(2, 1), (1, 2)])
def test_autoep_with_autotp_or_ulysses_is_refused_by_name(monkeypatch, tp, sp):
    """DeepSpeed's AutoTP refuses these models' tensor-parallel plans unless given a partition_config, and Ulysses
    with AutoEP is untested here: an engine with either beside AutoEP is refused before anything is saved."""
    from ucp_deepspeed.runtime import capture

    monkeypatch.setattr(capture.compat, "autoep_groups", lambda module: {"ep_size_2": 2})
    monkeypatch.setattr(capture.compat, "ulysses_outside_zero", lambda engine: False)
    monkeypatch.setattr(capture.compat, "sequence_parallel_size", lambda engine: sp)
    monkeypatch.setattr(capture, "model_parallel", lambda engine: capture.ModelParallel(tp=tp))
    engine = SimpleNamespace(module=None, zero_optimization_stage=lambda: 1, optimizer=None)
    assert "AutoEP (expert_parallel) together with AutoTP or Ulysses" in capture.unsupported(engine)
    monkeypatch.setattr(capture.compat, "autoep_groups", lambda module: {})
    assert capture.unsupported(engine) is None


@pytest.mark.slow  # the suite's budget; AutoEP resumes stay in the default run (the test above)
def test_autoep_spreads_a_ranks_experts_over_more_ranks(autoep_sources, tmp_path):
    """EP 2 at 2 ranks resumed at EP 2 x expert-DP 2 and at EP 4 on 4 ranks: each expert keeps its global id (before
    AutoEP's layout was read, a save recorded rank 0's stack as the whole tensor, and every such load was refused);
    plain DeepSpeed's AutoEP save at 2 ranks too (refused until its `ds_autoep_layers` placement was read)."""
    cases = [
        ("ep2z1", ("w2/mixtral/ep2z2", "w2/plain/ep2z1")),
        ("ep4z3", ("w2/mixtral/ep2z2",)),
        ("z1", ("w4/mixtral/ep1z1",)),  # AutoEP 1 -> off at the same topology: ours, not DeepSpeed's load
    ]
    check(load(autoep_sources, tmp_path, 4, {"mixtral": cases}), "mixtral", 4)


def test_autoep_names_derive_each_tensor_and_refuse_groups_that_differ():
    """The name map both ways, and the group rule: a live group may gather saved groups only if they compute the
    same update (DeepSpeed's MoE group names aside)."""
    from ucp_deepspeed.convert.expert_names import Derived, _regroup, derivations
    from ucp_deepspeed.errors import CheckpointError
    from ucp_deepspeed.format.manifest import GroupRecord, ParamRecord

    def record(shape: tuple[int, ...], group: int) -> ParamRecord:
        return ParamRecord(shape=shape, dtype="float32", group=group, trainable=True, file="", keys=("fp32",))

    p = "model.layers.0.mlp."
    autoep = {f"{p}experts.w1": record((4, 5, 3), 1), f"{p}experts.w3": record((4, 5, 3), 1)}
    autoep |= {f"{p}experts.w2": record((4, 3, 5), 1), f"{p}router.gate.weight": record((4, 3), 0)}
    hf = [f"{p}experts.gate_up_proj", f"{p}experts.down_proj", f"{p}gate.weight"]
    assert derivations(hf, autoep) == {
        hf[0]: Derived((f"{p}experts.w1", f"{p}experts.w3"), dim=1),
        hf[1]: Derived((f"{p}experts.w2",)),
        hf[2]: Derived((f"{p}router.gate.weight",)),
    }
    plain = {hf[0]: record((4, 10, 3), 0), hf[1]: record((4, 3, 5), 0), hf[2]: record((4, 3), 0)}
    assert derivations(list(autoep), plain)[f"{p}experts.w3"] == Derived((hf[0],), dim=1, start=5, length=5)
    assert derivations(hf, plain) == {} and derivations(hf, {}) == {}

    dense = GroupRecord({"lr": 1e-3, "weight_decay": 0.1}, {"step": 3})
    experts = GroupRecord({"lr": 1e-3, "weight_decay": 0.1, "name": "ep_size_2", "moe": True}, {"step": 3})
    inner = SimpleNamespace(manifest=SimpleNamespace(param_groups=(dense, experts)))
    merged = {
        n: record(plain[n].shape, r.group)
        for n, r in zip(hf, (autoep[f"{p}experts.w1"], autoep[f"{p}experts.w2"], autoep[f"{p}router.gate.weight"]))
    }
    assert _regroup(inner, merged, dict.fromkeys(hf, 0), 1, "here") == (dense,)
    inner.manifest.param_groups = (dense, GroupRecord({**experts.hyperparams, "lr": 2e-3}, {"step": 3}))
    with pytest.raises(CheckpointError, match="gathers saved groups 1 and 0, whose hyperparameters or steps differ"):
        _regroup(inner, merged, dict.fromkeys(hf, 0), 1, "here")


def test_autoep_names_read_a_range_without_the_whole_tensor():
    """Debt 10 of issue 65: a derived tensor (Hugging Face's fused gate_up from AutoEP's w1 and w3, or one half of it)
    was assembled whole at its first read. Every range and slice must equal the same cut of the whole, and read
    from the saved tensors no more than twice what it returns."""
    import dataclasses
    import random

    import torch

    from ucp_deepspeed.convert.expert_names import ExpertNames, derivations
    from ucp_deepspeed.format.manifest import GroupRecord, ParamRecord
    from ucp_deepspeed.format.universal import TensorReader

    @dataclasses.dataclass
    class Listing:  # the two fields of a manifest the view reads
        params: dict
        param_groups: tuple

    class Saved(TensorReader):
        def __init__(self, tensors: dict[str, torch.Tensor]):
            self.root, self.tensors, self.elements = "saved", tensors, 0
            self.params = {
                n: ParamRecord(shape=tuple(t.shape), dtype="float32", group=0, trainable=True, file="", keys=("fp32",))
                for n, t in tensors.items()
            }
            self.manifest = Listing(params=self.params, param_groups=(GroupRecord({"lr": 1e-3}, {}),))
            self.buffers = {}

        def read(self, name, key, start=0, numel=None):
            flat = self.tensors[name].reshape(-1)
            out = flat[start : flat.numel() if numel is None else start + numel].clone()
            self.elements += out.numel()
            return out

        def read_slice(self, name, key, dim, start, length):
            out = self.tensors[name].narrow(dim, start, length).clone()
            self.elements += out.numel()
            return out

        def read_buffer(self, name):
            raise AssertionError

        def load_state(self):
            return {}

        def close(self):
            pass

    p = "model.layers.0.mlp."
    w1, w3, w2 = (torch.randn(6, 5, 4), torch.randn(6, 5, 4), torch.randn(6, 4, 5))
    fused = torch.cat([w1, w3], dim=1)
    cases = [
        ({f"{p}experts.w1": w1, f"{p}experts.w3": w3, f"{p}experts.w2": w2}, {f"{p}experts.gate_up_proj": fused}),
        ({f"{p}experts.gate_up_proj": fused}, {f"{p}experts.w1": w1, f"{p}experts.w3": w3}),
        ({f"{p}experts.w2": w2}, {f"{p}experts.down_proj": w2}),
    ]
    rng = random.Random(0)
    for saved, live in cases:
        inner = Saved(saved)
        view = ExpertNames(inner, derivations(list(live), inner.params), dict.fromkeys(live, 0), 1)
        assert set(view.derived) == set(live)
        for name, whole in live.items():
            total = whole.numel()
            for _ in range(40):
                start = rng.randrange(total)
                numel = rng.randrange(1, total - start + 1)
                inner.elements = 0
                assert torch.equal(view.read(name, "fp32", start, numel), whole.reshape(-1)[start : start + numel])
                assert inner.elements == numel
                dim = rng.randrange(3)
                first = rng.randrange(whole.shape[dim])
                length = rng.randrange(1, whole.shape[dim] - first + 1)
                inner.elements = 0
                got = view.read_slice(name, "fp32", dim, first, length)
                assert torch.equal(got, whole.narrow(dim, first, length))
                assert inner.elements <= 2 * got.numel()
            assert torch.equal(view.read(name, "fp32"), whole.reshape(-1))
