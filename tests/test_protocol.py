"""The robot evaluation protocol: the paired bootstrap gain (hand-computed cases and properties),
the episode pairing it relies on (real robosuite envs), bad input, and the benchmark command end
to end on a tiny FPO++ Lift run (real demos, pretraining, two training runs on local Rays)."""

import itertools
import json
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

from flowrl_ray.stats import episode_gains, paired_bootstrap_gain  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


# --------------------------------------------------------------------------- the estimator

def test_two_episodes_by_hand():
    # one seed; the policy wins episode 1 only: d = [0, 1], gain 0.5. The 4 equally likely
    # resamples give 0, 0.5, 0.5, 1, so the 2.5 % / 97.5 % quantiles are 0 and 1.
    g = paired_bootstrap_gain([[0, 1]], [0, 0], n_boot=5000)
    assert g["gain"] == 0.5 and g["ci_low"] == 0.0 and g["ci_high"] == 1.0
    assert g["seeds"] == 1 and g["episodes"] == 2


def test_two_seeds_four_episodes_against_the_exact_bootstrap():
    policy = [[1, 1, 0, 0],
              [1, 0, 1, 0]]
    base = [0, 1, 0, 0]
    # d_e = mean over seeds of (policy - base) = [1, -0.5, 0.5, 0]; gain = 1/4
    np.testing.assert_allclose(episode_gains(policy, base), [1.0, -0.5, 0.5, 0.0])
    g = paired_bootstrap_gain(policy, base, n_boot=20_000, seed=1)
    assert g["gain"] == pytest.approx(0.25)
    # the exact bootstrap distribution: all 4^4 resamples of the episodes, equally likely
    d = [1.0, -0.5, 0.5, 0.0]
    exact = np.array([np.mean([d[i] for i in idx]) for idx in itertools.product(range(4), repeat=4)])
    lo, hi = np.quantile(exact, [0.025, 0.975])
    assert (lo, hi) == (-0.25, 0.75)           # resample means are multiples of 1/8
    assert g["ci_low"] == pytest.approx(lo, abs=0.125) and g["ci_high"] == pytest.approx(hi, abs=0.125)


def test_identical_policies_give_zero_and_a_constant_win_gives_one():
    rng = np.random.default_rng(0)
    base = rng.integers(0, 2, size=100)
    same = paired_bootstrap_gain(np.stack([base, base, base]), base)
    assert (same["gain"], same["ci_low"], same["ci_high"]) == (0.0, 0.0, 0.0)
    win = paired_bootstrap_gain(np.ones((3, 100)), np.zeros(100))
    assert (win["gain"], win["ci_low"], win["ci_high"]) == (1.0, 1.0, 1.0)


def test_pairing_removes_the_episodes_shared_difficulty():
    # the policies solve exactly what the base solves plus 10 more of 100 episodes: paired, every
    # resample sees only the 10 gains; unpaired (the base's episodes shuffled) the difficulty of
    # each episode no longer cancels, and the interval widens
    rng = np.random.default_rng(3)
    base = (rng.random(100) < 0.5).astype(float)
    policy = base.copy()
    policy[np.flatnonzero(base == 0)[:10]] = 1.0
    paired = paired_bootstrap_gain(np.stack([policy] * 3), base)
    shuffled = paired_bootstrap_gain(np.stack([policy] * 3), rng.permutation(base))
    assert paired["gain"] == pytest.approx(0.1) == shuffled["gain"]
    assert paired["ci_low"] > 0.0
    assert paired["ci_high"] - paired["ci_low"] < 0.5 * (shuffled["ci_high"] - shuffled["ci_low"])


def test_mismatched_episodes_are_refused():
    with pytest.raises(ValueError, match="same non-empty episodes"):
        paired_bootstrap_gain([[1, 0, 1]], [1, 0])
    with pytest.raises(ValueError, match="seeds, episodes"):
        paired_bootstrap_gain(np.zeros((2, 2, 2)), [0, 0])


# --------------------------------------------------------------------------- the pairing

def test_an_episode_key_names_the_same_initial_state_whatever_the_policy_did():
    """Env i's k-th evaluation episode starts from its seeded reset and k autoresets: what ran
    before (other actions, other episode lengths) must not change its initial state."""
    from flowrl_ray.config import config_from_dict
    from flowrl_ray.envs.robot import RobotEnv
    cfg = config_from_dict({"algorithm": "fpopp", "env": {"family": "robot", "id": "lift", "horizon_steps": 4,
                                                          "act_steps": 2, "max_episode_steps": 40}})
    starts = []
    for actions, steps in ((np.zeros((4, 7)), 2), (np.full((4, 7), 0.8), 7)):
        env = RobotEnv(cfg.env, None)
        try:
            first, _ = env.reset(seed=101)
            for _ in range(steps):
                env.step(actions)
            second, _ = env.reset()          # an autoreset: no seed
            starts.append((first, second))
        finally:
            env.close()
    np.testing.assert_array_equal(starts[0][0], starts[1][0])
    np.testing.assert_array_equal(starts[0][1], starts[1][1])
    assert not np.array_equal(starts[0][0], starts[0][1])       # the next episode is another scene


# --------------------------------------------------------------------------- the command

def test_overrides_after_seeds_are_overrides_and_a_variant_stays_a_variant():
    import robot_protocol
    parser = robot_protocol.build_parser()
    flags, overrides = robot_protocol.split_overrides(
        parser, ["--config", "c.yaml", "--seeds", "0", "1", "2", "algo.n_mc=16", "--variant", "a=r0,r1", "seed=3"])
    args = parser.parse_args(flags)
    assert args.seeds == [0, 1, 2] and args.variant == ["a=r0,r1"] and overrides == ["algo.n_mc=16", "seed=3"]


def test_bad_input_stops_with_one_line_naming_the_flag(tmp_path, capsys):
    import robot_protocol
    assert robot_protocol.main(["--variant", f"a={tmp_path / 'nope'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --variant a:") and "not a run directory" in err[0]
    assert robot_protocol.main(["--variant", "a"]) == 2
    assert "expected NAME=RUN_DIR" in capsys.readouterr().err
    assert robot_protocol.main(["--seeds", "0", "1"]) == 2
    assert "need --config" in capsys.readouterr().err
    cfg = str(REPO / "configs" / "fpopp" / "lift_state_quickstart.yaml")
    assert robot_protocol.main(["--config", cfg, "--seeds", "0", "algo.n_mcc=4"]) == 2
    assert "algo.n_mcc" in capsys.readouterr().err
    assert robot_protocol.main(["--config", cfg, "--seeds", "0", "seed=4"]) == 2
    assert "--seeds" in capsys.readouterr().err
    assert robot_protocol.main(["--config", cfg, "--seeds", "0", "--parallel", "0"]) == 2
    assert "--parallel" in capsys.readouterr().err


def test_reference_difference_is_the_mean_over_seeds_minus_the_references_by_hand():
    import robot_protocol as rp

    def runs(*per_seed):     # the same outcomes under both sampling rules
        return [{"outcomes": {s: {"successes": list(x)} for s in rp.SAMPLING_RULES}} for x in per_seed]

    def bid(env="lift", algorithm="fpopp", flow_steps=10):      # base ids as base_id writes them
        return json.dumps({"base": "p.pt", "env": {"id": env}, "algorithm": algorithm, "flow_steps": flow_steps},
                          sort_keys=True)

    b, other, elsewhere = bid(), bid(algorithm="reinflow", flow_steps=4), bid(env="can")
    bases = {b: {"outcomes": {s: {"successes": [1, 0, 1, 0]} for s in rp.SAMPLING_RULES}},
             other: {"outcomes": {s: {"successes": [0, 0, 0, 0]} for s in rp.SAMPLING_RULES}},
             elsewhere: {"outcomes": {s: {"successes": [0, 0, 0, 0]} for s in rp.SAMPLING_RULES}}}
    variants = {"ref": {"base": b, "runs": runs([1, 0, 0, 0], [1, 1, 0, 0])},     # per episode 1, .5, 0, 0
                "a": {"base": b, "runs": runs([1, 1, 1, 0], [1, 1, 0, 0])},       # per episode 1, 1, .5, 0
                "all": {"base": b, "runs": runs([1, 1, 1, 1], [1, 1, 1, 1])}}
    rp.summarise(bases, variants, n_boot=2000, reference="ref")
    assert "vs_reference" not in variants["ref"]
    d = variants["a"]["vs_reference"]["zero"]
    # 0.625 - 0.375; the episode differences are 0, .5, .5, 0, so every resample lies in [0, .5]
    assert d["gain"] == pytest.approx(0.25) and 0.0 <= d["ci_low"] < 0.25 < d["ci_high"] <= 0.5
    assert variants["a"]["gain"]["zero"]["gain"] == pytest.approx(0.625 - 0.5)   # the base gain is unchanged
    d = variants["all"]["vs_reference"]["random"]                   # 1 - (1, .5, 0, 0): mean .625
    assert d["gain"] == pytest.approx(0.625) and d["seeds"] == 2 and d["episodes"] == 4
    table = rp.reference_table(variants, lambda v: f"{100 * v:.0f} %", lambda v: f"{100 * v:+.1f}")
    assert "| a " in table and "+25.0" in table and "| ref " not in table.split("reference mean")[1].split("\n| a")[0]
    # another algorithm and flow steps on the same env: the same episodes, compared and marked
    variants["a"]["base"] = other
    rp.summarise(bases, variants, n_boot=2000, reference="ref")
    assert variants["a"]["vs_reference"]["compared"] and not variants["a"]["vs_reference"]["same_base"]
    assert variants["a"]["vs_reference"]["zero"]["gain"] == pytest.approx(0.25)
    assert variants["a"]["gain"]["zero"]["gain"] == pytest.approx(0.625)        # over its own base: 0
    table = rp.reference_table(variants, lambda v: f"{100 * v:.0f} %", lambda v: f"{100 * v:+.1f}")
    assert "| no " in table and "| yes " in table                        # the "same base setting" column
    variants["a"]["base"] = elsewhere        # another env section: other episodes, not compared
    rp.summarise(bases, variants, n_boot=10, reference="ref")
    assert variants["a"]["vs_reference"] == {"reference": "ref", "compared": False}
    assert variants["all"]["vs_reference"]["compared"] and variants["all"]["vs_reference"]["same_base"]
    table = rp.reference_table(variants, lambda v: f"{100 * v:.0f} %", lambda v: f"{100 * v:+.1f}")
    assert "| all " in table and "| a " not in table and "Not compared with the reference" in table
    assert table.rstrip().endswith(": a.")


def test_ood_gains_are_over_the_base_in_the_same_scene_and_the_reference_there_by_hand():
    import robot_protocol as rp

    def outs(x):
        return {s: {"successes": list(x)} for s in rp.SAMPLING_RULES}

    b = json.dumps({"base": "p.pt", "env": {"id": "lift"}, "algorithm": "fpopp", "flow_steps": 10}, sort_keys=True)
    bases = {b: {"outcomes": outs([1, 1, 1, 1]), "ood": {"friction": outs([0, 0, 1, 0])}}}
    variants = {"ref": {"base": b, "runs": [{"outcomes": outs([1, 1, 1, 1]), "ood": {"friction": outs(x)}}
                                            for x in ([0, 0, 1, 0], [1, 0, 1, 0])]},
                "a": {"base": b, "runs": [{"outcomes": outs([1, 1, 1, 1]), "ood": {"friction": outs(x)}}
                                          for x in ([1, 1, 1, 0], [1, 1, 1, 1])]}}
    rp.summarise(bases, variants, n_boot=2000, reference="ref")
    a = variants["a"]
    assert a["gain"]["zero"]["gain"] == pytest.approx(0.0)                       # in distribution: no gain
    assert a["ood"]["friction"]["success"]["zero"]["base"] == pytest.approx(0.25)
    assert a["ood"]["friction"]["gain"]["zero"]["gain"] == pytest.approx(0.875 - 0.25)
    assert a["vs_reference"]["ood"]["friction"]["random"]["gain"] == pytest.approx(0.875 - 0.375)
    table = rp.ood_table(variants, lambda v: f"{100 * v:.0f} %", lambda v: f"{100 * v:+.1f}")
    assert "| a       | friction" in table and "+62.5" in table and "+50.0" in table
    assert rp.ood_table({"x": {"ood": {}}}, str, str) == ""


def test_ood_sets_follow_the_task_and_refuse_what_it_cannot_take():
    import robot_protocol as rp

    from flowrl_ray.config import config_from_dict
    can = config_from_dict({"algorithm": "fpopp", "env": {"family": "robot", "id": "PickPlaceCan"}})
    assert rp.ood_sets(can, []) == ["friction", "action_noise"]
    with pytest.raises(rp.UsageError, match="--ood placement: not for PickPlaceCan"):
        rp.ood_sets(can, ["placement"])
    assert rp.perturbed(can, "friction").env.perturb.table_friction_scale == 0.2
    assert can.env.perturb.table_friction_scale == 1.0                          # the original is untouched


def test_reference_must_name_a_variant(tmp_path, capsys):
    import robot_protocol
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.yaml").write_text("name: x\n")
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "iter_000001.pt").write_bytes(b"")     # only its presence is checked here
    code = robot_protocol.main(["--variant", f"a={run}", "--reference", "b"])
    err = capsys.readouterr().err
    assert code == 2 and "--reference b: not a variant (variants: a)" in err, err


@pytest.mark.slow
def test_protocol_end_to_end_on_a_tiny_lift_run(tmp_path, capsys):
    """2 seeds x 2 iterations of a tiny FPO++ Lift config, trained 2 at a time, then the base and
    both final policies on the same 6 episodes; the numbers are read back and recomputed."""
    import robot_protocol

    from flowrl_ray.cli import main as cli
    demos, base = tmp_path / "lift.hdf5", tmp_path / "base.pt"
    assert cli(["demos", "lift", "--episodes", "2", "--out", str(demos)]) == 0
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({
        "name": "tiny-lift", "algorithm": "fpopp",
        "env": {"family": "robot", "id": "lift", "horizon_steps": 4, "act_steps": 2,
                "max_episode_steps": 10, "dataset": str(demos)},
        "train": {"iterations": 2},
        "runtime": {"num_workers": 1, "envs_per_worker": 2, "rollout_length": 6, "checkpoint_interval": 0},
        "eval": {"interval": 2, "episodes": 2, "at_start": True},
        "algo": {"base_policy": str(base), "hidden_sizes": [32, 32], "critic_hidden_sizes": [16],
                 "minibatch_size": 12, "n_mc": 2, "flow_steps": 3, "critic_warmup_iters": 1, "epochs": 1}}))
    assert cli(["pretrain", str(config), "--epochs", "2", "--batch-size", "32"]) == 0
    capsys.readouterr()

    results = tmp_path / "results"
    common = ["--episodes", "6", "--n-boot", "2000", "--results-dir", str(results)]
    assert robot_protocol.main(["--config", str(config), "--seeds", "0", "1", "--parallel", "2",
                                "--runs-dir", str(tmp_path / "runs"), "--output", "smoke", *common]) == 0
    out = capsys.readouterr().out
    assert "seed 1 finished" in out and "has 2 seed(s)" in out
    data = json.loads((results / "smoke.json").read_text())
    v = data["variants"]["tiny-lift"]
    assert [r["seed"] for r in v["runs"]] == [0, 1]
    (base_entry,) = data["bases"].values()
    for s in ("zero", "random"):
        b = base_entry["outcomes"][s]
        assert len(b["successes"]) == 6 and b["keys"] == sorted(b["keys"])
        assert sorted(map(tuple, b["keys"])) == [(i, k) for i in range(6) for k in range(1)]   # 6 envs, 1 each
        per_seed = [r["outcomes"][s]["successes"] for r in v["runs"]]
        assert all(r["outcomes"][s]["keys"] == b["keys"] for r in v["runs"])    # the same episodes
        gain = np.mean([np.mean(p) for p in per_seed]) - np.mean(b["successes"])
        assert v["gain"][s]["gain"] == pytest.approx(gain)
        assert v["gain"][s]["ci_low"] <= v["gain"][s]["gain"] <= v["gain"][s]["ci_high"]
        assert v["success"][s]["per_seed"] == pytest.approx([np.mean(p) for p in per_seed])
    for r in v["runs"]:
        assert r["iterations"] == 2 and r["env_steps"] == 2 * 2 * 6 and r["launch_wall_s"] > 0
        assert len(r["train_curve"]) >= 1 and [x for x, _ in r["eval_curve"]] == [0, 24]
    assert data["machine"]["CPU"] and "logical" in data["machine"]["cores"]
    for png in ("smoke_train.png", "smoke_eval.png"):
        assert (results / png).read_bytes()[:4] == b"\x89PNG"
    md = (results / "smoke.md").read_text()
    assert re.search(r"\| tiny-lift +\| random +\| 2 +\|", md) and "## Machine" in md

    # the finished runs again (--runs groups them by their config name, the variant's), in a new
    # evaluation with new envs: the same outcomes
    runs = [r["run_dir"] for r in v["runs"]]
    assert robot_protocol.main(["--runs", *runs, "--output", "again", *common]) == 0
    again = json.loads((results / "again.json").read_text())
    assert list(again["bases"].values())[0]["outcomes"] == base_entry["outcomes"]
    assert [r["outcomes"] for r in again["variants"]["tiny-lift"]["runs"]] == [r["outcomes"] for r in v["runs"]]

    # out of distribution: the same episodes in a scene with action noise, for the base and both runs
    assert robot_protocol.main(["--runs", *runs, "--output", "ood", "--ood", "action_noise", *common]) == 0
    ood = json.loads((results / "ood.json").read_text())
    (b_ood,) = ood["bases"].values()
    assert list(b_ood["ood"]) == ["action_noise"] and b_ood["outcomes"] == base_entry["outcomes"]
    v_ood = ood["variants"]["tiny-lift"]
    for s in ("zero", "random"):
        noisy = b_ood["ood"]["action_noise"][s]
        assert noisy["keys"] == base_entry["outcomes"][s]["keys"]                     # the same episodes
        per_seed = [r["ood"]["action_noise"][s]["successes"] for r in v_ood["runs"]]
        gain = np.mean([np.mean(p) for p in per_seed]) - np.mean(noisy["successes"])
        assert v_ood["ood"]["action_noise"]["gain"][s]["gain"] == pytest.approx(gain)
    assert "| tiny-lift | action_noise" in (results / "ood.md").read_text()


def test_missing_image_demos_are_recorded_with_the_configs_cameras(tmp_path, monkeypatch):
    """An image config's demos are made with its cameras at its image size (without them the
    demos hold no images and pretraining refuses the dataset); the command is run for real."""
    import subprocess

    import h5py
    from _robot import ensure_demos_and_base

    from flowrl_ray.config import load_config
    demos, base = tmp_path / "lift_image.hdf5", tmp_path / "base.pt"
    cfg = load_config(REPO / "configs/fpopp/lift_image_quickstart.yaml",
                      [f"env.dataset={demos}", f"algo.base_policy={base}", "env.image_size=32"])
    commands = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, check: commands.append(cmd))
    ensure_demos_and_base("c.yaml", cfg, "lift", 1, 3)
    demo_cmd, pretrain_cmd = commands
    i = demo_cmd.index("demos")
    assert demo_cmd[i:i + 2] == ["demos", "lift"] and demo_cmd[demo_cmd.index("--cameras") + 1] == "agentview"
    assert demo_cmd[demo_cmd.index("--image-size") + 1] == "32"
    assert pretrain_cmd[-2:] == ["--epochs", "3"]
    monkeypatch.undo()
    from flowrl_ray.cli import main as cli
    assert cli(demo_cmd[i:]) == 0
    with h5py.File(demos) as f:
        assert f["data/demo_0/obs/agentview_image"].shape[1:] == (32, 32, 3)


# --------------------------------------------------------------------------- the forms protocol

def test_forms_protocol_summary_splits_the_task_kinds_by_hand():
    import forms_protocol as fp
    kinds = ["heldout_values", "heldout_values", "heldout_forms", "heldout_forms"]
    base = {"kinds": kinds, "field_accuracy": [0.5, 0.0, 1.0, 0.0], "task_completion": [0, 0, 1, 0],
            "rewards": [0.2, 0.0, 1.0, 0.0]}
    runs = [{"outcomes": {"field_accuracy": [1.0, 0.5, 1.0, 0.0], "task_completion": [1, 0, 1, 0],
                          "rewards": [0.8, 0.2, 1.0, 0.0]}},
            {"outcomes": {"field_accuracy": [0.5, 0.5, 0.5, 0.5], "task_completion": [0, 0, 0, 0],
                          "rewards": [0.2, 0.2, 0.5, 0.5]}}]
    s = fp.summarise(base, runs, n_boot=200)
    assert s["all"]["tasks"] == 4 and s["heldout_values"]["tasks"] == 2 and s["heldout_forms"]["tasks"] == 2
    fa = s["heldout_values"]["field_accuracy"]
    # base 0.25; seeds 0.75 and 0.5: gain = mean over seeds of (policy - base) = +0.375
    assert fa["base"] == 0.25 and fa["per_seed"] == [0.75, 0.5] and fa["gain"]["gain"] == pytest.approx(0.375)
    forms = s["heldout_forms"]["field_accuracy"]
    assert forms["base"] == 0.5 and forms["gain"]["gain"] == pytest.approx(0.0)     # 0.5 - 0.5, 0.5 - 0.5
    assert s["all"]["task_completion"]["gain"]["gain"] == pytest.approx((0.25 + -0.25) / 2)


def test_forms_protocol_checks_its_flags_as_the_robot_protocol_does(tmp_path, capsys):
    import forms_protocol as fp
    cfg = str(REPO / "configs" / "flow_grpo" / "forms_small.yaml")
    for argv, named in ([["--seeds", "0", "1"], "need --config"],
                        [["--config", cfg], "--config needs --seeds"],
                        [["--config", cfg, "--seeds", "0", "0"], "repeated seed"],
                        [["--config", cfg, "--seeds", "0", "seed=4"], "--seeds and --name"],
                        [["--config", cfg, "--seeds", "0", "--parallel", "0"], "--parallel"],
                        [["--config", cfg, "--seeds", "0", "--tasks", "0"], "--tasks"]):
        assert fp.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and named in err[0], (argv, err)
    assert not (tmp_path / "runs").exists()


def test_forms_protocol_refuses_a_robot_config_and_a_missing_sft_base(tmp_path, capsys):
    import forms_protocol as fp
    assert fp.main(["--config", str(REPO / "configs/fpopp/lift_state_quickstart.yaml"), "--seeds", "0"]) == 2
    assert "forms protocol is for flow_grpo" in capsys.readouterr().err
    cfg = yaml.safe_load((REPO / "configs/flow_grpo/forms_small.yaml").read_text())
    cfg["algo"]["sft_checkpoint"] = str(tmp_path / "missing")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert fp.main(["--config", str(tmp_path / "c.yaml"), "--seeds", "0", "1", "2"]) == 2
    assert "algo.sft_checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- the molecule protocol

def test_fed_grpo_protocol_summary_by_hand():
    import fed_grpo_protocol as mp
    nan = float("nan")
    base = {"formation_energy_per_atom_eV": [-4.0, nan, -2.0, -3.0], "rms_force": [2.0, nan, 4.0, 6.0],
            "stable_atom_fraction": [1.0, 0.5, 0.5, 0.0], "stable": [1, 0, 0, 0], "valid": [1, 0, 1, 0],
            "under_bonded": [0, 2, 1, 3], "over_bonded": [0, 0, 1, 0]}
    seed0 = {**base, "formation_energy_per_atom_eV": [-5.0, -1.0, -3.0, nan], "rms_force": [1.0, 1.0, 2.0, nan],
             "stable_atom_fraction": [1.0, 1.0, 0.5, 0.5], "valid": [1, 1, 1, 0]}
    seed1 = {**base, "formation_energy_per_atom_eV": [-4.0, -1.0, -4.0, -9.0], "rms_force": [2.0, 1.0, 2.0, 0.5],
             "stable": [1, 1, 0, 0]}
    s = mp.summarise(base, [{"outcomes": seed0}, {"outcomes": seed1}], n_boot=200)
    # physics on the molecules scored for the base and both seeds: 0 and 2
    assert s["scored_by_all"] == 2 and s["rms_force"]["n"] == 2
    assert s["rms_force"]["base"] == 3.0 and s["rms_force"]["per_seed"] == [1.5, 2.0]
    assert s["rms_force"]["change"]["gain"] == pytest.approx((1.5 + 2.0) / 2 - 3.0)
    assert s["formation_energy_per_atom_eV"]["change"]["gain"] == pytest.approx((-4.0 + -4.0) / 2 - (-3.0))
    # stability on all 4, in points: base 50; seeds 75 and 50 -> +12.5
    st = s["stable_atom_fraction"]
    assert st["n"] == 4 and st["base"] == 50.0 and st["per_seed"] == [75.0, 50.0]
    assert st["change"]["gain"] == pytest.approx(12.5)
    assert s["stable"]["change"]["gain"] == pytest.approx(12.5) and s["valid"]["change"]["gain"] == pytest.approx(12.5)
    assert s["under_bonded"]["unit"] == "atoms" and s["under_bonded"]["change"]["gain"] == 0.0


def test_fed_grpo_protocol_refuses_other_algorithms_and_a_missing_base(tmp_path, capsys):
    import fed_grpo_protocol as mp
    assert mp.main(["--config", str(REPO / "configs/flow_grpo/forms_small.yaml"), "--seeds", "0"]) == 2
    assert "molecule protocol is for fed_grpo" in capsys.readouterr().err
    cfg = yaml.safe_load((REPO / "configs/fed_grpo/qm9_small.yaml").read_text())
    cfg["algo"]["base_model"] = str(tmp_path / "missing.pt")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert mp.main(["--config", str(tmp_path / "c.yaml"), "--seeds", "0", "1", "2"]) == 2
    assert "algo.base_model" in capsys.readouterr().err
    assert mp.main(["--config", str(tmp_path / "c.yaml"), "--seeds", "0", "--molecules", "0"]) == 2
    assert "--molecules" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
