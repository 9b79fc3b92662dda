"""DeepSpeed native MoE (`deepspeed.moe.layer.MoE`, 4 experts, top-2): change the expert-parallel size on resume.

Experts are stored under global expert ids. Each target launch compares every expert's and every dense
parameter's fp32 weight and Adam states (keyed by global name, merged over all expert-parallel ranks),
buffers, the frozen parameter, hyperparameters, scheduler and counters with torch.equal, then checks the
next 3 losses against the uninterrupted run.
"""

from __future__ import annotations

import pytest
from conftest import OnDemand, load_results, torchrun
from launching import each

LOSS_RTOL = 1e-5

# source name: (world size, expert-parallel size, variants saved by one launch); the same variants saved by plain
# DeepSpeed first in the launch, under `<source>/plain/` (no ucp metadata: the experts are placed off its own files)
SAVES = {"ep2w2": (2, 2, ("moez1", "moez2")), "ep2w4": (4, 2, ("moez2",)), "ep1w1": (1, 1, ("moez1",))}
PLAIN = ("ep2w2", "ep2w4")

# the default run loads at one rank from the 2-rank save (two launches); the other cells need a launch per world size
SLOW = pytest.mark.slow
TARGETS = [
    pytest.param(1, 1, "moez1", ("ep2w2/moez1", "ep2w2/moez2", "ep2w2/plain/moez2"), id="ep1-z1<-ep2-z1,z2,plain-z2"),
    pytest.param(2, 2, "moez1", ("ep1w1/moez1",), id="ep2-z1<-ep1", marks=SLOW),
    pytest.param(4, 4, "moez2", ("ep2w2/moez1", "ep2w2/plain/moez1"), id="ep4-z2<-ep2-z1,plain-z1", marks=SLOW),
    pytest.param(
        3, 1, "moez2", ("ep2w4/moez2", "ep2w4/plain/moez2"), id="ep1-dp3-z2<-ep2-edp2-dp4-z2,plain", marks=SLOW
    ),
]


@pytest.fixture(scope="session")
def moe_sources(tmp_path_factory: pytest.TempPathFactory) -> OnDemand:
    """MoE checkpoints after three steps (`SAVE/VARIANT`), one launch per save, run when a test first reads it."""
    out = tmp_path_factory.mktemp("moe_sources")

    def launch(save: str) -> None:
        world, ep, variants = SAVES[save]
        runs = [["save", "--out", str(out / save), "--ep", str(ep), "--variant", *variants]]
        if save in PLAIN:
            runs.insert(
                0, ["save", "--plain", "--out", str(out / save / "plain"), "--ep", str(ep), "--variant", *variants]
            )
        torchrun(world, *each(runs), attempts=2)

    names = [f"{save}/{variant}" for save, (_, _, variants) in SAVES.items() for variant in variants]
    names += [f"{save}/plain/{variant}" for save in PLAIN for variant in SAVES[save][2]]
    return OnDemand(out, names, lambda name: name.split("/")[0], launch)


@pytest.mark.parametrize("world,ep,target,sources", TARGETS)
def test_moe_reshard(moe_sources, tmp_path, world, ep, target, sources):
    results_file = tmp_path / "results.json"
    torchrun(
        world,
        "load",
        "--variant",
        target,
        "--ep",
        str(ep),
        "--results",
        str(results_file),
        "--source",
        *(str(moe_sources[s]) for s in sources),
    )
    results = load_results(results_file)
    assert len(results) == len(sources)
    for r in results:
        label = f"{r['saved']} -> {r['live']}"
        assert r["mode"] == "resharded", label
        assert r["diffs"] == [], f"{label}: restored state differs:\n" + "\n".join(r["diffs"])
        assert r["tensors"] >= 80, label  # 4 experts x 4 tensors x (fp32, 2 states, lp) and the dense part
        assert r["max_rel_loss"] <= LOSS_RTOL, f"{label}: losses {r['losses']} vs {r['reference_losses']}"


@SLOW
def test_wrong_expert_count_is_refused(moe_sources, tmp_path):
    results_file = tmp_path / "results.json"
    torchrun(
        1,
        "load",
        "--mismatch",
        "--variant",
        "moez1",
        "--ep",
        "1",
        "--results",
        str(results_file),
        "--source",
        str(moe_sources["ep2w2/moez1"]),
    )
    outcome = load_results(results_file)
    assert outcome["error"] is not None, "a checkpoint with 4 experts loaded into a model with 8"
    assert "checkpoint has 4 experts, the model has 8 (expert-parallel size 1 x 8 local experts)" in outcome["error"]
    assert outcome["untouched"], "state was modified before the mismatch was detected"
