"""``rollout-sync plan``: layouts parsed and checked with one-line errors, the report, the JSON line and the
plot. Small models only (the 1T-parameter runs are the command's job, not the suite's)."""

from __future__ import annotations

import json

import pytest
from test_scale_planning import KIMI, QWEN3_MOE

from rollout_sync.cli import main
from rollout_sync.errors import DryRunSpecError
from rollout_sync.scale.report import JSON_KEYS
from rollout_sync.scale.spec import check_fit, load_model, parse_rollout, parse_trainer
from rollout_sync.shapes import model_tensors


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_layouts_parse_with_defaults():
    t = parse_trainer("zero=3, tp=2, world=8")
    assert (t.zero, t.tp, t.ep, t.world, t.dp, t.gpus_per_node) == (3, 2, 1, 8, 4, 8)
    r = parse_rollout("engines=8,tp=16,ep=16,gpus_per_node=4")
    assert (r.engines, r.tp, r.ep, r.world, r.gpus_per_node) == (8, 16, 16, 128, 4)


@pytest.mark.parametrize(
    ("trainer", "rollout", "message"),
    [
        ("zero=3,tp=3,world=8", "engines=1,tp=4", "trainer world=8 is not divisible by tp=3"),
        ("zero=3,world=8", "engines=1,tp=64", "rollout tp=64 is above the model's 32 attention heads"),
        ("zero=3,tp=64,world=64", "engines=1,tp=4", "trainer tp=64 is above the model's 32 attention heads"),
        ("zero=3,world=8", "engines=1,tp=3", "rollout tp=3 does not divide the model's 32 attention heads"),
        ("zero=3,world=8,ep=2", "engines=1,tp=4", "trainer ep=2 but the model has no routed experts"),
        ("zero=3,world=8", "engines=1,tp=4,ep=2", "rollout ep=2: vLLM's expert parallelism spans"),
        ("zero=5,world=8", "engines=1,tp=4", "ZeRO stage must be 0, 1, 2 or 3"),
        ("zero=3,world=8,pp=2", "engines=1,tp=4", "unknown trainer layout key 'pp'"),
        ("zero=3", "engines=1,tp=4", "trainer layout 'zero=3' lacks world"),
        ("zero=3,world=eight", "engines=1,tp=4", "trainer layout world='eight' is not an integer"),
        ("zero=3,world=8", "engines=0,tp=4", "rollout layout engines=0 must be positive"),
        ("zero=3,world=8", "engines=1 tp=4", "engines='1 tp=4' is not an integer (items are key=value"),
        ("zero=3,world=8", "engines=1,tp", "rollout layout item 'tp' is not key=value"),
    ],
)
def test_a_wrong_or_impossible_layout_is_one_line_naming_the_problem(capsys, trainer, rollout, message):
    code, out, err = run(capsys, "--model", "qwen3-8b", "--trainer", trainer, "--rollout", rollout)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("rollout-sync plan: error: "), err
    assert message in err
    assert "None" not in err


def test_moe_layouts_that_do_not_divide_are_refused_before_any_map_is_built():
    moe = model_tensors(QWEN3_MOE)  # 8 experts
    with pytest.raises(DryRunSpecError, match="trainer ep=3 does not divide the model's 8 experts"):
        check_fit(moe, parse_trainer("zero=1,ep=3,world=6"), parse_rollout("engines=1,tp=2"))
    with pytest.raises(DryRunSpecError, match="AutoTP does not partition experts"):
        check_fit(moe, parse_trainer("zero=1,tp=2,world=4"), parse_rollout("engines=1,tp=2"))
    with pytest.raises(DryRunSpecError, match="ep=3 does not divide the data-parallel size 4"):
        parse_trainer("zero=1,ep=3,world=4")
    with pytest.raises(DryRunSpecError, match=r"AutoEP .* with AutoTP"):
        parse_trainer("zero=1,ep=2,tp=2,world=8")


def test_a_rollout_tp_that_splits_kv_heads_unevenly_is_refused():
    model = model_tensors({**QWEN3_MOE, "num_attention_heads": 12, "num_key_value_heads": 8})
    with pytest.raises(
        DryRunSpecError, match="tp=12 is neither a divisor nor a multiple of the model's 8 kv"
    ):
        check_fit(model, parse_trainer("zero=1,world=2"), parse_rollout("engines=1,tp=12,ep=12"))


def test_a_missing_or_broken_model_config_is_one_line(capsys, tmp_path):
    code, _, err = run(
        capsys,
        "--model",
        str(tmp_path / "nope.json"),
        "--trainer",
        "zero=3,world=2",
        "--rollout",
        "engines=1,tp=2",
    )
    assert code == 2 and "neither a preset nor a config.json file" in err and err.count("\n") == 1
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    code, _, err = run(
        capsys, "--model", str(tmp_path), "--trainer", "zero=3,world=2", "--rollout", "engines=1,tp=2"
    )
    assert code == 2 and "cannot read" in err and err.count("\n") == 1


def test_a_config_json_path_plans_like_its_shapes(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(KIMI))
    label, model = load_model(str(path))
    assert label == str(path)
    assert model == model_tensors(KIMI)
    assert load_model(str(tmp_path))[1] == model


def test_the_json_line_is_last_and_carries_the_issues_keys(capsys):
    code, out, _ = run(
        capsys,
        "--model",
        "qwen3-0.6b",
        "--trainer",
        "zero=1,tp=2,world=8",
        "--rollout",
        "engines=2,tp=4,gpus_per_node=4",
        "--in-process",
        "--json",
    )
    assert code == 0
    last = out.rstrip("\n").splitlines()[-1]
    got = json.loads(last)
    assert list(got)[: len(JSON_KEYS)] == list(JSON_KEYS)
    assert got["policy"] == "balanced" and set(got["compare"]) == {"lowest"}
    assert got["segments"] > 0 and got["source_pieces"] > 0 and got["target_pieces"] > 0
    assert got["halves_agree"] is True
    assert 0 < got["lower_bound_s"] <= got["modeled_s"]
    # ZeRO-1 replicas: the balanced policy spreads the sends, lowest does not
    assert got["max_send_bytes"] < got["compare"]["lowest"]["max_send_bytes"]
    assert "modeled sync" in out and "lower bound" in out


def test_each_policy_runs_in_a_fresh_process_and_the_plot_shows_both(capsys, tmp_path):
    png = tmp_path / "traffic.png"
    code, out, err = run(
        capsys,
        "--model",
        "qwen3-0.6b",
        "--trainer",
        "zero=2,world=4",
        "--rollout",
        "engines=1,tp=2",
        "--policy",
        "lowest",
        "--no-rounds",
        "--plot",
        str(png),
        "--json",
    )
    assert code == 0, err
    got = json.loads(out.rstrip("\n").splitlines()[-1])
    assert got["policy"] == "lowest" and set(got["compare"]) == {"balanced"}
    assert got["rounds"] == {}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {png}" in out


def test_only_runs_the_chosen_policy(capsys):
    code, out, _ = run(
        capsys,
        "--model",
        "qwen3-0.6b",
        "--trainer",
        "zero=3,world=4,gpus_per_node=4",
        "--rollout",
        "engines=1,tp=4,gpus_per_node=4",
        "--only",
        "--in-process",
        "--no-rounds",
        "--json",
        "--shared-nodes",
    )
    assert code == 0
    got = json.loads(out.rstrip("\n").splitlines()[-1])
    assert "compare" not in got and got["shared_nodes"] is True


def test_the_help_documents_the_time_model_and_its_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    for text in ("time(GPU)", "default", "350", "50", "Lower bound", "--shared-nodes", "policy.Spread"):
        assert text in out, text
