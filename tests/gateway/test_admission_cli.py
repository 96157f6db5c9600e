"""``agentgate serve``'s admission and retention flags reach the gateway config; bad values
are refused with the flag named."""

from pathlib import Path

import pytest

from gateway.cli import CliError, _build_parser, serve_kwargs
from gateway.routing.admission import AdmissionConfig


def _options(model_dir: Path, tmp_path: Path, *argv: str) -> dict:
    args = _build_parser().parse_args(
        ["serve", "--model", str(model_dir), "--tenant-secret-file", str(tmp_path / "s"), *argv])
    return serve_kwargs(args, env={})["gateway_options"]


def test_defaults(sim_model_dir: Path, tmp_path: Path) -> None:
    options = _options(sim_model_dir, tmp_path)
    assert options["admission_config"] == AdmissionConfig()
    assert options["retain_ttl_s"] == 60.0 and options["admission"] is True


def test_flags_reach_the_admission_config(sim_model_dir: Path, tmp_path: Path) -> None:
    options = _options(sim_model_dir, tmp_path, "--admission-buckets", "1000,8000",
                       "--admission-shares", "0.5,0.3,0.2", "--admission-max-queued", "9",
                       "--admission-max-queued-per-tenant", "3", "--tenant-weight", "t-ab=2.5",
                       "--tenant-weight", "anonymous=0.5", "--retain-ttl", "0")
    cfg = options["admission_config"]
    assert cfg.bucket_bounds_tokens == (1000, 8000) and cfg.bucket_shares == (0.5, 0.3, 0.2)
    assert (cfg.max_queued, cfg.max_queued_per_tenant) == (9, 3)
    assert cfg.weight_of("t-ab") == 2.5 and cfg.weight_of("anonymous") == 0.5
    assert cfg.weight_of("t-other") == 1.0 and options["retain_ttl_s"] == 0.0


@pytest.mark.parametrize(("flag", "value"), [
    ("--admission-buckets", "1,x"), ("--admission-shares", "a"), ("--tenant-weight", "t-a"),
    ("--tenant-weight", "t-a=0"), ("--admission-max-queued", "0"), ("--retain-ttl", "-1"),
])
def test_bad_values_refused(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _build_parser().parse_args(["serve", flag, value])
    assert exc.value.code == 2 and flag in capsys.readouterr().err


def test_shares_must_match_buckets(sim_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(CliError, match="admission"):
        _options(sim_model_dir, tmp_path, "--admission-buckets", "1000,8000")


def test_a_keys_file_weighs_its_tenants_unless_a_flag_does(sim_model_dir: Path,
                                                           tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text('[tenants.acme]\nkeys = ["sk-acme-0123456789abcdef"]\nweight = 3\n'
                    '[tenants.beta]\nkeys = ["sk-beta-0123456789abcdef"]\nweight = 4\n')
    options = _options(sim_model_dir, tmp_path, "--api-keys", str(keys),
                       "--tenant-weight", "beta=0.5")
    cfg = options["admission_config"]
    assert cfg.weight_of("acme") == 3.0 and cfg.weight_of("beta") == 0.5
    assert options["api_keys"].tenant_of_key("sk-acme-0123456789abcdef").name == "acme"
