"""`rapidlite env`: versions, hardware and usable kernels for a bug report, as text or JSON, without importing the
heavy optional libraries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import REPO
from rapidlite.cli import env as env_report
from rapidlite.cli.main import main
from rapidlite.precision import cpu_bf16_is_fast


def test_the_report_as_json_without_importing_heavy_libraries():
    code = (
        "import io, contextlib, json, sys\n"
        "from rapidlite.cli.main import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    assert main(['env', '--json']) == 0\n"
        "heavy = sorted(m for m in ('transformers', 'datasets', 'deepspeed', 'bitsandbytes', 'matplotlib', 'wandb',\n"
        "                           'peft') if m in sys.modules)\n"
        "print(json.dumps({'report': json.loads(out.getvalue()), 'heavy': heavy}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["heavy"] == []
    report = result["report"]
    assert set(report) == {"system", "packages", "torch", "kernels and backends", "environment"}
    assert report["torch"]["version"] == torch.__version__ == report["packages"]["torch"]
    for name in ("transformers", "datasets", "tokenizers", "deepspeed", "peft", "bitsandbytes", "apex", "matplotlib"):
        assert name in report["packages"]  # a version, or null when not installed
    assert report["system"]["python"].startswith(".".join(map(str, sys.version_info[:3])))
    kernels = report["kernels and backends"]
    assert kernels["gloo"]["usable"] is torch.distributed.is_gloo_available()
    assert kernels["nccl"]["usable"] is (torch.cuda.is_available() and torch.distributed.is_nccl_available())
    assert kernels["bf16 on cpu"]["usable"] is cpu_bf16_is_fast()  # what --mixed-precision decides on this CPU
    for name in ("torch.compile", "apex fused kernels", "deepspeed ops", "bitsandbytes", "sdpa cpu"):
        assert isinstance(kernels[name]["detail"], str) and kernels[name]["detail"]


def test_the_report_as_text(capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("rapidlite env")
    for section in ("[system]", "[packages]", "[torch]", "[kernels and backends]", "[environment]"):
        assert section in text
    assert f"torch:         {torch.__version__}" in text
    assert "OMP_NUM_THREADS:" in text and "gloo:" in text and "torch.compile:" in text


def test_missing_packages_and_checks_read_plainly(monkeypatch):
    monkeypatch.setattr(env_report, "_version", lambda name: None if name in ("deepspeed", "apex") else "1.0")
    report = {
        "packages": env_report.packages_section(),
        "kernels and backends": env_report._deepspeed_check(torch, {}),
    }
    text = env_report.render(report)
    assert "deepspeed:     not installed    [deepspeed]: --deepspeed" in text
    assert "deepspeed ops: no   DeepSpeed is not installed: pip install 'rapidlite[deepspeed]'" in text


def test_lm_eval_is_reported_as_what_the_tests_compare_with():
    """rapidlite-eval does not import lm_eval (setup.py's test extra compares its scores with the harness's):
    the report says so rather than listing lm_eval as rapidlite-eval's need."""
    used_for = dict(env_report.PACKAGES)["lm_eval"]
    assert "[test]" in used_for and "not imported" in used_for
    package = Path(env_report.__file__).parents[1]
    files = [*(package / "evaluation").glob("*.py"), package / "cli" / "evaluate.py"]
    assert len(files) > 3 and not any(
        "import lm_eval" in f.read_text() or "from lm_eval" in f.read_text() for f in files
    )


@pytest.mark.parametrize(("argv", "message"), [(["env", "--bogus"], "unrecognized arguments: --bogus")])
def test_flag_mistakes_are_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_help_names_the_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "rapidlite env" in out and "rapidlite plot DIR" in out
