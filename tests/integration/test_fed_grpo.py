"""FED-GRPO tests that take seconds each on a busy 2-core machine (more than the unit folder's
2 s): the update's direction and KL, the exact resume of generation, the committed base EDM
sampling molecules, the resumable pretraining. The rest: tests/unit/algorithms/test_fed_grpo.py."""

import json

import numpy as np
import pytest
import torch

from flowrl_ray.algorithms.fed_grpo import FEDGRPO

from conftest import REPO
from unit.algorithms.test_fed_grpo import TINY_MODEL, _algo, _config, _scored


def _objective_gradient(algo: FEDGRPO, prepared: dict) -> list[torch.Tensor]:
    """d/dtheta of sum_{i,t} A_it log p_theta(z_t-1 | z_t), per parameter."""
    from flowrl_ray.models.edm import step_log_prob
    traj = prepared["trajectory"]
    algo.model.zero_grad(set_to_none=True)
    for j, t in enumerate(traj["t"].tolist()):
        logp, _ = step_log_prob(algo.model, traj["z"][j], traj["z"][j + 1], t, traj["node_mask"])
        (prepared["advantages"][:, j] * logp).sum().backward()
    grads = [p.grad.clone() for p in algo.model.parameters()]
    algo.model.zero_grad(set_to_none=True)
    return grads

def test_update_starts_at_ratio_one_and_moves_up_the_advantage_weighted_log_prob():
    algo = _algo(lr=1e-6, clip=10.0, kl_coeff=0.0)
    chunks = algo.generate(2)
    prepared = algo.prepare(_scored(chunks, force=[1, 2, 3, 3, 2, 1], energy=[0] * 6))
    grads = _objective_gradient(algo, prepared)
    before = [p.detach().clone() for p in algo.model.parameters()]
    metrics = algo.update(prepared)
    # one optimiser step per epoch (micro-batch = all rows): every ratio is computed before it
    assert metrics["fed_grpo/ratio_min"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["fed_grpo/ratio_max"] == pytest.approx(1.0, abs=1e-6)
    # the step goes up the policy gradient: <grad sum A log p, delta theta> > 0 (a flipped
    # surrogate sign would go down). First order only: an untrained EDM's late transitions are
    # so sharp (sigma_1 = 0.003) that any finite step changes log p by orders of magnitude.
    step = sum(float((g * (p.detach() - b)).sum()) for g, p, b in zip(grads, algo.model.parameters(), before))
    assert step > 0

def test_kl_penalty_is_zero_at_the_start_and_grows_after_updates():
    algo = _algo(lr=1e-3, clip=10.0, kl_coeff=0.04, epochs=2)
    chunks = algo.generate(2)
    metrics = algo.update(algo.prepare(_scored(chunks, force=[1, 2, 3, 3, 2, 1], energy=[0] * 6)))
    # epoch 1 at the reference (kl 0), epoch 2 after one step (kl > 0): the mean is positive
    assert metrics["kl"] > 0
    first = _algo(kl_coeff=0.04)
    m0 = first.update(first.prepare(_scored(first.generate(1), force=[1, 2, 3, 3, 2, 1], energy=[0] * 6)))
    assert m0["kl"] == pytest.approx(0.0, abs=1e-12)

def test_state_round_trip_reproduces_generation():
    a = _algo()
    a.update(a.prepare(_scored(a.generate(1), force=[1, 2, 3, 3, 2, 1], energy=[0] * 6)))
    b = _algo()
    b.load_state_dict(a.state_dict())
    ca, cb = a.generate(1), b.generate(1)
    for pa, pb in zip(ca[0]["positions"], cb[0]["positions"]):
        np.testing.assert_array_equal(pa, pb)

@pytest.mark.parametrize("config", ["qm9_small", "qm9_mid"])
def test_the_committed_base_edm_loads_into_its_config_and_samples_molecules(config):
    """pretrained/qm9_small_edm.pt (CPU) and pretrained/qm9_mid_edm.pt (GPU), made by the commands
    in docs/results.md, are the bases of configs/fed_grpo/qm9_small.yaml and qm9_mid.yaml: same
    architecture, QM9's atom-count histogram, a stability curve (small) or the 1,000-sample
    evaluation (mid); each samples molecules of QM9's atom types with finite coordinates."""
    from flowrl_ray.models.edm import check_base_model, load_base_model
    from flowrl_ray.config import load_config
    from flowrl_ray.envs.molecules.chemistry import ATOM_TYPES
    from flowrl_ray.models.edm import EDM
    from flowrl_ray.pretrain.edm_qm9 import sample_molecules
    root = REPO
    cfg = load_config(root / "configs" / "fed_grpo" / f"{config}.yaml")
    path = root / cfg.algo.base_model
    check_base_model(cfg, path)                                   # ConfigError on another architecture
    ckpt = load_base_model(path)
    if config == "qm9_small":
        assert ckpt["steps"] >= 6000 and ckpt["curve"] and ckpt["curve"][-1]["step"] == ckpt["steps"]
    else:                       # its whole training state comes with it: `pretrain --resume` continues it
        assert ckpt["steps"] >= 40500 and ckpt["batch_size"] == 256 and "train_state" in ckpt
        assert ckpt["eval"]["num_molecules"] == 1000
        assert ckpt["eval"]["atom_stability"] > 0.9 and ckpt["eval"]["validity"] > 0.4
    histogram = np.asarray(ckpt["node_histogram"])
    assert histogram.sum() == pytest.approx(1.0)                  # QM9: 3 to 29 atoms, most often 19
    assert list(np.nonzero(histogram)[0][[0, -1]]) == [3, 29] and histogram.argmax() == 19
    if config == "qm9_mid":             # 1000 reverse steps of a 6 x 128 EGNN: minutes on a busy CPU,
        cfg.algo.model.diffusion_steps = 50   # so the test samples on a 50-step schedule of the same net
    model = EDM(cfg.algo.model)
    model.load_state_dict(ckpt["state_dict"])
    mols = sample_molecules(model, histogram, 3, seed=0)
    assert len(mols) == 3
    for positions, types in mols:
        assert 3 <= len(types) <= 29 and positions.shape == (len(types), 3) and np.isfinite(positions).all()
        assert ((types >= 0) & (types < len(ATOM_TYPES))).all()

def test_the_laptop_config_from_the_gpu_base_is_its_architecture_with_the_imported_bases_post_training():
    """configs/fed_grpo/qm9_mid_cpu.yaml: qm9_mid.yaml's EDM and base (check_base_model refuses
    another architecture), qm9_edm_small.yaml's post-training, ELIGN's 600 of 1000 shared steps."""
    from dataclasses import asdict

    from flowrl_ray.config import load_config
    from flowrl_ray.models.edm import check_base_model
    cpu, mid, small = (load_config(REPO / "configs" / "fed_grpo" / f"{n}.yaml") for n in ("qm9_mid_cpu", "qm9_mid",
                                                                                          "qm9_edm_small"))
    assert asdict(cpu.algo.model) == asdict(mid.algo.model) and cpu.algo.base_model == mid.algo.base_model
    check_base_model(cpu, REPO / cpu.algo.base_model)
    assert cpu.algo.shared_prefix_steps == 600 and cpu.algo.model.diffusion_steps == 1000
    for key in ("sample_group_size", "each_prompt_sample", "lr", "clip", "kl_coeff", "normalize_over",
                "zero_mean_groups", "advantage_mode", "train_micro_batch_size"):
        assert getattr(cpu.algo, key) == getattr(small.algo, key), key
    assert cpu.env.kwargs == small.env.kwargs and cpu.train.iterations == small.train.iterations


def test_pretraining_stops_at_a_checkpoint_after_max_minutes_and_resumes_with_its_batch_and_lr(tmp_path):
    """--checkpoint-every 1 --max-minutes (a moment): the invocation ends after its first step with
    the checkpoint written; --resume without --batch-size / --lr takes the checkpoint's and reaches
    the weights of the uninterrupted run."""
    from flowrl_ray.config import config_from_dict
    from flowrl_ray.pretrain.edm_qm9 import pretrain_edm
    cfg = config_from_dict(_config())
    whole, parts = tmp_path / "whole.pt", tmp_path / "parts.pt"
    pretrain_edm(cfg, out=whole, steps=4, batch_size=4, lr=1e-3, eval_samples=0, progress=False)
    first = pretrain_edm(cfg, out=parts, steps=4, batch_size=4, lr=1e-3, checkpoint_every=1,
                         max_minutes=1e-9, eval_samples=0, progress=False)
    assert first["steps"] == 1 and torch.load(parts, weights_only=False)["steps"] == 1
    pretrain_edm(cfg, out=parts, steps=4, resume=True, eval_samples=0, progress=False)
    a, b = (torch.load(p, weights_only=False) for p in (whole, parts))
    assert (b["steps"], b["batch_size"], b["lr"]) == (4, 4, 1e-3)
    for name, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][name]), name

def test_pretraining_resumed_from_its_checkpoint_is_the_uninterrupted_run(tmp_path, capsys, monkeypatch):
    """4 steps in one run and 2 + 2 with --resume give the same weights; the curve rows come with
    the checkpoint; a checkpoint of another architecture is refused naming the key."""
    from flowrl_ray.cli import main
    from flowrl_ray.config import ConfigError, config_from_dict
    from flowrl_ray.pretrain.edm_qm9 import pretrain_edm
    cfg = config_from_dict(_config())
    whole, parts = tmp_path / "whole.pt", tmp_path / "parts.pt"
    kw = dict(batch_size=4, lr=1e-3, curve_every=2, curve_samples=2, progress=False)
    pretrain_edm(cfg, out=whole, steps=4, eval_samples=0, **kw)
    pretrain_edm(cfg, out=parts, steps=2, eval_samples=0, **kw)
    summary = pretrain_edm(cfg, out=parts, steps=4, resume=True, eval_samples=2, **kw)
    a, b = (torch.load(p, weights_only=False) for p in (whole, parts))
    assert a["steps"] == b["steps"] == summary["steps"] == 4
    for name, value in a["state_dict"].items():                       # the EMA weights
        assert torch.equal(value, b["state_dict"][name]), name
    for name, value in a["train_state"]["raw_state_dict"].items():
        assert torch.equal(value, b["train_state"]["raw_state_dict"][name]), name
    assert [r["step"] for r in b["curve"]] == [2, 4] == [r["step"] for r in summary["curve"]]
    assert {"atom_stability", "molecule_stability", "validity"} <= set(b["curve"][0])
    assert (tmp_path / "parts.stability.png").is_file()
    rows = [json.loads(line) for line in (tmp_path / "parts.metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "atom_stability" in r] == [2, 4]
    # at its end already: nothing is trained or sampled again, its evaluation stands
    import flowrl_ray.pretrain.edm_qm9 as pm
    monkeypatch.setattr(pm, "evaluate_model", lambda *a, **k: pytest.fail("sampled again"))
    again = pretrain_edm(cfg, out=parts, steps=4, resume=True, eval_samples=2, **kw)
    assert again["steps"] == 4 and again["eval"] == summary["eval"]
    wider = config_from_dict(_config(model={**TINY_MODEL, "hidden_size": TINY_MODEL["hidden_size"] + 8}))
    with pytest.raises(ConfigError, match="algo.model.hidden_size"):
        pretrain_edm(wider, out=parts, steps=6, resume=True, **kw)
    forms = REPO / "configs" / "flow_grpo" / "forms_small.yaml"
    assert main(["pretrain", str(forms), "--curve-every", "5"]) == 2
    err = capsys.readouterr().err
    assert "--curve-every: flow_grpo's pretraining (text_sft) has no such setting; it takes --out, --steps" in err


def _pack(path, molecules: int = 40, seed: int = 0):
    """A QM9 pack of made-up molecules (3-9 atoms in a 3 Å box): what pretraining reads without qm9pack."""
    from flowrl_ray.envs.molecules import qm9
    rng = np.random.default_rng(seed)
    n = rng.integers(3, 10, size=molecules)
    positions, types = qm9._pad(rng.uniform(-1.5, 1.5, size=(n.sum(), 3)),
                                rng.integers(0, 5, size=n.sum()).astype(np.int8), n)
    data = qm9.QM9Data(positions=positions, atom_types=types, n_atoms=n.astype(np.int16),
                       smiles=np.array(["C"] * molecules), index=np.arange(1, molecules + 1, dtype=np.int32))
    qm9.save_pack(data, path, "train")
    return path


def test_pretraining_from_a_base_on_a_qm9_pack_starts_at_the_bases_weights_and_resumes(tmp_path):
    """--init-from: a new run whose raw and EMA weights start at the base's (at lr 1e-12 they stay
    there; without it they are a fresh model's); --qm9: the pack's molecules are the train split;
    --resume continues the run it wrote, not the base; bad keys are named."""
    from flowrl_ray.config import ConfigError, config_from_dict
    from flowrl_ray.pretrain.edm_qm9 import pretrain_edm
    cfg = config_from_dict(_config())
    pack, base, cont, fresh = _pack(tmp_path / "train.npz"), *(tmp_path / f"{s}.pt" for s in ("base", "cont", "fresh"))
    kw = dict(batch_size=4, qm9=pack, eval_samples=0, progress=False)
    pretrain_edm(cfg, out=base, steps=3, lr=1e-3, **kw)
    summary = pretrain_edm(cfg, out=cont, steps=2, lr=1e-12, init_from=base, seed=5, **kw)
    pretrain_edm(cfg, out=fresh, steps=2, lr=1e-12, seed=5, **kw)
    b, c, f = (torch.load(p, weights_only=False) for p in (base, cont, fresh))
    assert summary["molecules"] == 40 and summary["init_from"] == str(base) == c["init_from"]
    assert c["steps"] == 2 and np.array_equal(c["node_histogram"], b["node_histogram"])
    for name, value in b["state_dict"].items():         # the base's EMA weights start both copies
        assert torch.allclose(c["state_dict"][name], value, atol=1e-6), name
        assert torch.allclose(c["train_state"]["raw_state_dict"][name], value, atol=1e-6), name
    assert any(not torch.allclose(f["state_dict"][k], v, atol=1e-3) for k, v in b["state_dict"].items())
    again = pretrain_edm(cfg, out=cont, steps=4, lr=1e-3, init_from=base, resume=True, **kw)
    assert again["steps"] == 4 and torch.load(cont, weights_only=False)["init_from"] == str(base)
    with pytest.raises(ConfigError, match="'pretrain.init_from': no such file"):
        pretrain_edm(cfg, out=tmp_path / "x.pt", steps=1, init_from=tmp_path / "none.pt", **kw)
    with pytest.raises(ConfigError, match="'pretrain.qm9': .*base.pt is not a QM9 pack"):
        pretrain_edm(cfg, out=tmp_path / "x.pt", steps=1, batch_size=4, qm9=base, progress=False)
    wider = config_from_dict(_config(model={**TINY_MODEL, "hidden_size": TINY_MODEL["hidden_size"] + 8}))
    with pytest.raises(ConfigError, match="algo.model.hidden_size"):
        pretrain_edm(wider, out=tmp_path / "x.pt", steps=1, init_from=base, **kw)
    assert not (tmp_path / "x.pt").exists()


#: what a bare GPU machine (torch, numpy, PyYAML; transformers and peft) lacks
NOT_ON_A_BARE_MACHINE = ("ray", "rdkit", "qm9pack", "pandas", "scipy", "matplotlib", "gymnasium", "robosuite",
                         "mujoco", "h5py", "playwright", "tblite", "xtb", "PIL", "imageio", "tensorboard")


def test_the_gpu_command_for_edm_runs_without_ray_rdkit_qm9pack_or_matplotlib(tmp_path):
    """`flowrl-ray pretrain CONFIG --init-from BASE --qm9 PACK` in a Python where every package a bare
    GPU machine lacks fails to import: it trains, writes the checkpoint and the metrics, says there
    are no PNG curves; the verbs of the robot family answer with the import that failed."""
    import subprocess
    import sys

    import yaml
    from flowrl_ray.config import config_from_dict
    from flowrl_ray.pretrain.edm_qm9 import pretrain_edm
    pack, base, out = _pack(tmp_path / "train.npz"), tmp_path / "base.pt", tmp_path / "out" / "cont.pt"
    pretrain_edm(config_from_dict(_config()), out=base, steps=1, batch_size=4, qm9=pack, progress=False)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(_config()))
    prelude = ("import sys\n"
               f"for name in {NOT_ON_A_BARE_MACHINE!r}:\n"
               "    sys.modules[name] = None\n"            # `import name` raises ImportError
               "from flowrl_ray.cli import main\n"
               "sys.exit(main(sys.argv[1:]))\n")
    run = subprocess.run([sys.executable, "-c", prelude, "pretrain", str(config), "--init-from", str(base),
                          "--qm9", str(pack), "--steps", "2", "--batch-size", "4", "--checkpoint-every", "1",
                          "--eval-samples", "0", "--device", "cpu", "--out", str(out), "--resume"],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["init_from"] == str(base) and summary["loss_plot"] is None
    assert "no PNG curves" in run.stdout and out.is_file() and (out.parent / "cont.metrics.jsonl").is_file()
    assert not (out.parent / "cont.loss.png").exists()
    demos = subprocess.run([sys.executable, "-c", prelude, "demos", "--task", "lift"], capture_output=True,
                           text=True, cwd=REPO, timeout=300)
    assert demos.returncode == 2
    assert "flowrl_ray.envs.robot cannot be imported" in demos.stderr and "pip install -e '.[robot]'" in demos.stderr


def test_the_agreement_benchmarks_channels_by_hand_and_its_report(tmp_path):
    """benchmarks/fed_grpo_gradient_agreement.py: each channel's advantages from a hand-made
    batch (force and energy over the valid members, 0 for the invalid; validity over the group;
    the shuffle a permutation within each group), then a tiny EDM end to end with the real
    force field: every variant's cosines over every pair, the results files."""
    import sys

    import yaml
    sys.path.insert(0, str(REPO / "benchmarks"))
    import fed_grpo_gradient_agreement as bench
    algo = _algo()
    p = algo.prepare(_scored(algo.generate(2), force=[-1, -3, -9, -2, -2, -2], energy=[0, 0, 0, 1, 3, 5],
                             valid=[1, 1, 0, 1, 1, 1]))
    adv = bench.channel_advantages(p, algo.pending["group_index"], torch.Generator().manual_seed(0))
    k = p["advantages"].shape[1]
    assert torch.allclose(adv["force"][:, 0], torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0, 0.0]), atol=1e-6)
    e = 1.0 / (8 / 3) ** 0.5                                   # (1, 3, 5): mean 3, population std sqrt(8/3)
    assert torch.allclose(adv["energy"][:, 0], torch.tensor([0.0, 0.0, 0.0, -2 * e, 0.0, 2 * e]), atol=1e-6)
    v = 1 / 2 ** 0.5                                           # (1, 1, 0): mean 2/3, std sqrt(2)/3
    assert torch.allclose(adv["validity"][:3, 0].float(), torch.tensor([v, v, -2 * v]), atol=1e-6)
    assert torch.equal(adv["validity"][3:], torch.zeros(3, k, dtype=adv["validity"].dtype))
    for name in bench.CHANNELS:
        assert adv[name].shape == (6, k) and torch.equal(adv[name], adv[name][:, :1].expand(-1, k))
        for rows in (slice(0, 3), slice(3, 6)):                # the same values, within each group
            assert sorted(adv[f"{name} shuffled"][rows, 0].tolist()) == sorted(adv[name][rows, 0].tolist())
    assert bench.signal_to_noise(0.5, 16) == pytest.approx(1 / 16) and np.isnan(bench.signal_to_noise(-0.1, 16))

    config = tmp_path / "fed.yaml"
    config.write_text(yaml.safe_dump(_config()))
    r = bench.main(["--config", str(config), "--batches", "3", "--steps", "2", "--threads", "1",
                    "--n-boot", "100", "--results-dir", str(tmp_path), "--output", "agree"])
    assert set(r["variants"]) == {*bench.CHANNELS, *(f"{c} shuffled" for c in bench.CHANNELS)}
    for v in r["variants"].values():
        assert v["cosine"]["n"] == 3 and all(-1.0 <= c <= 1.0 for c in v["pair_cosines"])
    saved = json.loads((tmp_path / "agree.json").read_text())
    assert saved["steps"] == [0, 5] and (tmp_path / "agree.md").read_text().startswith("# FED-GRPO")
    bench.main(["--from-json", str(tmp_path / "agree.json"), "--n-boot", "100", "--results-dir", str(tmp_path),
                "--output", "again"])                          # the report again, the same table
    table = lambda name: (tmp_path / name).read_text().split("| advantages")[1]    # noqa: E731
    assert table("again.md") == table("agree.md")
