"""python -m fusednorm explain TARGET / cache list|clear|path."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest

from fusednorm.__main__ import main
from fusednorm.report import Report

MODEL_FILE = textwrap.dedent("""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    D, H = 32, 4


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(D)
            self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

        def forward(self, x, context):
            B, L, _ = x.shape
            split = lambda t: t.view(B, -1, H, D // H).transpose(1, 2)
            h = self.norm(x)
            a = F.scaled_dot_product_attention(split(self.q(h)), split(self.k(context)), split(self.v(context)))
            return x + self.o(a.transpose(1, 2).reshape(B, L, D))


    def build():
        torch.manual_seed(0)
        return Block().eval(), (torch.randn(2, 5, D),), {"context": torch.randn(2, 7, D)}


    def two_blocks():
        torch.manual_seed(0)
        blocks = [Block().eval(), Block().eval()]
        ctx = torch.randn(2, 7, D)
        return (lambda x: blocks[1](blocks[0](x, ctx), ctx)), [torch.randn(2, 5, D)]
""")


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(MODEL_FILE)
    return path


def _norm_line() -> int:
    return next(i for i, line in enumerate(MODEL_FILE.splitlines(), 1) if "h = self.norm(x)" in line)


def test_explain_a_file_prints_the_table(model_file, capsys):
    assert main(["explain", str(model_file)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fusednorm: 1 block fused")
    assert f"my_model.py:{_norm_line()}" in out


def test_explain_json_is_a_report(model_file, capsys):
    assert main(["explain", f"{model_file}:two_blocks", "--json"]) == 0
    report = Report.from_json(capsys.readouterr().out)
    assert len(report.matches) == 2
    assert all(m.locations["norm"].endswith(f"my_model.py:{_norm_line()}") for m in report.matches)


def test_explain_a_module_callable(model_file, capsys, monkeypatch):
    monkeypatch.chdir(model_file.parent)
    monkeypatch.delitem(sys.modules, "my_model", raising=False)
    assert main(["explain", "my_model:build", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["matches"]) == 1


def test_explain_dump_option_writes_dumps(model_file, tmp_path, capsys):
    dump_dir = tmp_path / "dumps"
    assert main(["explain", str(model_file), "--dump", str(dump_dir)]) == 0
    assert Report.from_json((dump_dir / "report.json").read_text()).matches
    assert (dump_dir / "report.txt").read_text().startswith("fusednorm: 1 block fused")
    assert any(p.startswith("graph_") for p in os.listdir(dump_dir))


@pytest.mark.parametrize("source, target, message", [
    (None, "missing.py", "no such file: "),
    ("x = 1\n", "{file}", "defines no build(); define build() returning (model, args)"),
    ("build = 3\n", "{file}", "is a int, not a callable"),
    ("def build():\n    return 1\n", "{file}", "must return (model, args) or (model, args, kwargs), got a int"),
    ("def build():\n    return (1, 2, 3, 4)\n", "{file}", "got a tuple of 4 item(s)"),
    ("import torch\ndef build():\n    return torch.nn.Identity(), torch.ones(1)\n", "{file}",
     "args (second item) must be a tuple or list of inputs, got Tensor; wrap a single input as (x,)"),
    ("def build():\n    raise KeyError('weights')\n", "{file}", "build() raised KeyError: 'weights'"),
    ("import no_such_package_here\n", "{file}", "importing"),
    (None, "no_such_module_xyz:build", "no module named 'no_such_module_xyz'"),
])
def test_bad_targets_are_named(tmp_path, capsys, source, target, message):
    file = tmp_path / "target.py"
    if source is not None:
        file.write_text(source)
    assert main(["explain", target.format(file=file)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fusednorm explain: ") and message in err, err
    assert "Traceback" not in err


def test_a_model_that_fails_on_its_inputs_is_reported(tmp_path, capsys):
    file = tmp_path / "broken.py"
    file.write_text("import torch\ndef build():\n    return torch.nn.Linear(3, 3), (torch.ones(2, 4),)\n")
    assert main(["explain", str(file)]) == 1
    assert "running the model on the given inputs failed" in capsys.readouterr().err


def test_the_module_entry_point_runs(model_file):
    done = subprocess.run([sys.executable, "-m", "fusednorm", "explain", str(model_file)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "1 block fused" in done.stdout


# ---- cache

def _fake_entry(folder, key: str, registers: int) -> None:
    from fusednorm.codegen.cache import MAGIC

    cubin = b"\x7fELF fake cubin"
    header = {"key": key, "fingerprint": "f" * 64, "cubin_sha256": hashlib.sha256(cubin).hexdigest(),
              "usage": {"registers": registers, "spill_stores": 0, "spill_loads": 0, "stack_frame": 0,
                        "static_smem": 0}}
    (folder / f"{key}.fnk").write_bytes(MAGIC + json.dumps(header).encode() + b"\n" + cubin)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "kernels"
    folder.mkdir()
    monkeypatch.setenv("FUSEDNORM_CACHE_DIR", str(folder))
    _fake_entry(folder, "pnca_bf16_d64_layer_gb_mnone_t64x64_sm90", 96)
    _fake_entry(folder, "pnca_fp16_d128_rms_g_mbool_t64x64_sm90", 128)
    (folder / "garbage.fnk").write_bytes(b"not an entry")
    return folder


def test_cache_list(cache, capsys):
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert main(["cache"]) == 0   # listing is the default
    assert capsys.readouterr().out == out
    assert out.startswith(f"3 cached kernel(s) in {cache}")
    row = next(line for line in out.splitlines() if "pnca_fp16_d128" in line)
    assert " 128 " in row
    assert "bad magic" in next(line for line in out.splitlines() if "garbage" in line)


def test_cache_list_json(cache, capsys):
    assert main(["cache", "list", "--json"]) == 0
    entries = {e["key"]: e for e in json.loads(capsys.readouterr().out)}
    assert entries["pnca_bf16_d64_layer_gb_mnone_t64x64_sm90"]["usage"]["registers"] == 96
    assert entries["garbage"]["problem"]


def test_cache_clear_by_key_then_all(cache, capsys):
    assert main(["cache", "clear", "--key", "fp16"]) == 0
    assert "removed 1 cached kernel(s)" in capsys.readouterr().out
    left = sorted(p.name for p in cache.glob("*.fnk"))
    assert left == ["garbage.fnk", "pnca_bf16_d64_layer_gb_mnone_t64x64_sm90.fnk"]
    assert main(["cache", "clear"]) == 0
    assert "removed 2 cached kernel(s)" in capsys.readouterr().out
    assert list(cache.iterdir()) == []
    assert main(["cache", "list"]) == 0
    assert capsys.readouterr().out.startswith("no cached kernels in ")


def test_cache_path(cache, capsys):
    assert main(["cache", "path"]) == 0
    assert capsys.readouterr().out.strip() == str(cache)


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["cache", "shred"])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
