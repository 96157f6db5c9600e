"""The ``agentgate`` CLI: ``model init`` is deterministic and loads anywhere; ``generate`` runs."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from gateway.cli import DEMO_FILES, main
from gateway.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "model"
    assert main(["model", "init", str(out)]) == 0
    return out


def _digests(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


def test_model_init_writes_the_same_bytes_every_time(demo_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: a fresh HOME and no AGENTGATE_MTP_CACHE: nothing cached, this one distills again
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("AGENTGATE_MTP_CACHE")
    again = tmp_path / "again"
    assert main(["model", "init", str(again)]) == 0
    assert set(DEMO_FILES) <= set(_digests(demo_dir))
    assert _digests(again) == _digests(demo_dir)
    # the distillation's output was kept, and a third init copies it
    [entry] = (tmp_path / "home" / ".cache" / "agentgate" / "mtp-distill").iterdir()
    assert {p.name for p in entry.iterdir()} == {"model.safetensors"}
    third = tmp_path / "third"
    assert main(["model", "init", str(third)]) == 0
    assert _digests(third) == _digests(demo_dir)


def test_model_init_refuses_a_non_empty_dir(demo_dir: Path, tmp_path: Path, capsys) -> None:
    target = tmp_path / "busy"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    assert main(["model", "init", str(target)]) == 2
    assert "not empty" in capsys.readouterr().err and (target / "keep.txt").exists()
    assert main(["model", "init", "--force", str(target)]) == 0
    assert _digests(target) == _digests(demo_dir)


@torch.inference_mode()
def test_demo_model_loads_in_transformers_with_the_same_logits(demo_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(demo_dir)
    ours_tok = Tokenizer.from_dir(demo_dir)
    text = "Hello, agent! Ünïcödé ✓"
    ids = ours_tok.encode(text)
    assert tok.encode(text, add_special_tokens=False) == ids
    ref = transformers.MiMoV2FlashForCausalLM.from_pretrained(
        demo_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ours = LLM(demo_dir, device="cpu")
    expected = ref(torch.tensor([ids])).logits[0]
    assert (ours.prompt_logits(ids) - expected).abs().max().item() < 1e-4


def test_generate_prints_the_greedy_completion(demo_dir: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "generate", "--model", str(demo_dir),
         "--max-new-tokens", "8", "Hello"],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    tokenizer = Tokenizer.from_dir(demo_dir)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    [out] = LLM(demo_dir).generate([tokenizer.encode("Hello")], params)
    expected = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert proc.stdout == expected + "\n"
    assert "generated tokens" in proc.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--model", "/nonexistent/model", "x"], "not a model directory"),
        (["generate", "--temperature", "-1", "--model", "{demo}", "x"], "temperature"),
        (["generate", "--dtype", "float8", "--model", "{demo}", "x"], "float8"),
    ],
)
def test_generate_reports_bad_input(demo_dir: Path, argv: list[str], message: str, capsys) -> None:
    argv = [a.replace("{demo}", str(demo_dir)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("agentgate: error:") and message in err
