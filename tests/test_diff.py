"""`ucp diff`: a checkpoint and its universal copy are identical; one changed value is found and measured."""

from __future__ import annotations

import json
import shutil

from safetensors.torch import load_file, save_file

from ucp_deepspeed import convert
from ucp_deepspeed.format.universal import record_bytes
from ucp_deepspeed.tools.cli import main as cli_main
from ucp_deepspeed.tools.compare import diff


def test_diff_finds_exactly_what_changed(sources, tmp_path, capsys):
    native = sources["z2"]
    copy = convert(str(native), output=str(tmp_path / "u"), progress=False)
    same = diff(str(native), copy)
    assert same.identical and len(same.states) >= 10
    assert cli_main(["diff", str(native), copy]) == 0

    changed = tmp_path / "changed"
    shutil.copytree(copy, changed)
    manifest = json.loads((changed / "manifest.json").read_text())
    name = next(n for n, r in manifest["params"].items() if r["trainable"])
    path = changed / manifest["params"][name]["file"]
    tensors = load_file(path)
    tensors["exp_avg"].view(-1)[3] += 0.25
    save_file(tensors, path)  # same shapes and dtypes, so the same size as the manifest says
    relpath = manifest["params"][name]["file"]
    manifest["files"][relpath] = record_bytes(relpath, path.read_bytes()).to_json()  # as if saved that way
    (changed / "manifest.json").write_text(json.dumps(manifest))

    report = diff(copy, str(changed))
    differing = [s for s in report.states if not s.equal]
    assert [(s.name, s.key) for s in differing] == [(name, "exp_avg")]
    assert abs(differing[0].max_abs - 0.25) < 1e-6 and not report.values
    capsys.readouterr()
    assert cli_main(["diff", copy, str(changed)]) == 1
    assert f"{name}:exp_avg  max abs 0.25" in capsys.readouterr().out
    assert cli_main(["diff", copy, str(changed), "--atol", "0.3"]) == 0

    other = diff(str(native), str(sources["sgdz2"]))  # the same model trained with SGD: no Adam moments
    assert not other.identical and all(e.endswith((":exp_avg", ":exp_avg_sq")) for e in other.only_a) and other.only_a
