"""`--kv-evict kvp`: the learned scorers' checkpoint is checked against the served model when the
launcher starts, and every bad checkpoint exits naming its cause."""

import json

import pytest

from sgl_vtoken.config import EvictConfig


@pytest.fixture
def kvp_checkpoint(tmp_path):
    """`kvp_checkpoint(layers)`: an (untrained) KVP scorer for a tiny-model-shaped model."""
    from sgl_vtoken.kvp import KVPScorer, ModelIdentity, save_checkpoint

    def make(layers=2, heads=2, head_dim=32):
        idt = ModelIdentity("llama", num_layers=layers, num_kv_heads=heads, head_dim=head_dim)
        return str(
            save_checkpoint(
                KVPScorer(idt, hidden=4), tmp_path / f"kvp-{layers}-{heads}-{head_dim}.st"
            )
        )

    return make


def test_kvp_checkpoint_for_the_served_model_is_accepted(parse, tiny_model, kvp_checkpoint):
    path = kvp_checkpoint()
    parse(
        "--model-path",
        str(tiny_model),
        "--kv-evict",
        "kvp",
        "--kv-budget",
        "64",
        "--kv-evict-config",
        json.dumps({"checkpoint": path}),
    )
    cfg = EvictConfig.from_env()
    assert (cfg.policy, cfg.params["checkpoint"]) == ("kvp", path)


@pytest.mark.parametrize(
    "kind,needle",
    [
        ("none", "KVP.checkpoint is required"),
        ("missing", "KVP checkpoint '{path}': no such file"),
        ("garbage", "KVP checkpoint '{path}': not a readable safetensors file"),
        ("layers", "is for another model (num_layers: checkpoint 3, model 2)"),
        ("heads", "num_kv_heads: checkpoint 4, model 2; head_dim: checkpoint 16, model 32"),
    ],
)
def test_kvp_bad_checkpoints_exit_at_start_up_naming_the_cause(
    parse, capsys, tiny_model, tmp_path, kvp_checkpoint, kind, needle
):
    path = {
        "none": "",
        "missing": str(tmp_path / "nope.st"),
        "garbage": str(tmp_path / "garbage.st"),
        "layers": kvp_checkpoint(layers=3),
        "heads": kvp_checkpoint(heads=4, head_dim=16),
    }[kind]
    (tmp_path / "garbage.st").write_bytes(b"\x00" * 64)
    config = "{}" if kind == "none" else json.dumps({"checkpoint": path})
    with pytest.raises(SystemExit) as e:
        parse(
            "--model-path",
            str(tiny_model),
            "--kv-evict",
            "kvp",
            "--kv-budget",
            "64",
            "--kv-evict-config",
            config,
        )
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "argument --kv-evict-config:" in err and needle.format(path=path) in err, err


def test_kvp_needs_a_readable_model_config(parse, capsys, kvp_checkpoint):
    with pytest.raises(SystemExit):
        parse(
            "--model-path",
            "/nonexistent",
            "--kv-evict",
            "kvp",
            "--kv-budget",
            "64",
            "--kv-evict-config",
            json.dumps({"checkpoint": kvp_checkpoint()}),
        )
    assert "cannot read the config of --model-path '/nonexistent'" in capsys.readouterr().err
