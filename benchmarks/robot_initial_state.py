"""How much of a robot episode's outcome its initial state decides, and where fine-tuned policies
gain or lose.

A whole-episode label (FlowSAR's success / failure, any outcome-only advantage) mixes two things:
which initial state the episode started from (some object placements are harder than others)
and what the policy's sampled actions did from there. Only the second says which actions to
prefer. This tool evaluates the base policy R times on the robot protocol's seeded initial states
(``robot_protocol.py``: the evaluation seed, 8 envs), each time with another action-noise seed,
by random sampling (the training rollouts' rule; with zero sampling the state alone decides),
and splits the outcome's variance:

- the state share: the one-way intra-class correlation ICC(1) of the R outcomes per state
  (``flowrl_ray.stats.state_share``), with a 95 % bootstrap interval over states: 1 when the
  initial state decides the outcome, 0 when the sampled actions do;
- the share of states the base solves in every repeat, in none, in some;
- the object's initial position per state (read off the env after the same seeded reset and
  autoresets as the protocol's episodes), the rank correlation of the base's per-state success
  with each coordinate, and a scatter plot coloured by per-state success.

``--base-from`` reuses an earlier result's base outcomes and positions instead of evaluating.
With ``--protocol RESULT.json`` (a ``robot_protocol.py`` result on the same base, evaluation
seed and episodes) it also splits each variant's outcomes by the base's per-state success: the
states are grouped by the base's repeats 1..R-1 (never / sometimes / always solved), and within
each group the variant's success (its seeds' protocol outcomes) is set against the base's
repeat 0, which used the same action noise as the variant's evaluation and plays no part in the
grouping (so the groups carry no regression to the mean). Repeat 0 must reproduce the
protocol's base outcomes; the tool checks it.

Run from the repository root (one policy evaluation per repeat: ~2.5 min on Lift, ~4 min on Can,
2 cores):

    .venv/bin/python benchmarks/robot_initial_state.py --config configs/flowsar/can_state_quickstart.yaml \\
        --repeats 4 --protocol benchmarks/results/flowsar_can_default_shuffled.json --output flowsar_can_initial_state

Results: ``benchmarks/results/<output>.md/.json`` and ``<output>.png``. No assertion is made:
this is a measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, command_line, git_revision, machine_info, md_table, write_json, write_results  # noqa: E402
from _robot import EVAL_ENVS, EVAL_SEED, base_policy, evaluate_episodes, make_eval_runner  # noqa: E402

GROUPS = ("never", "sometimes", "always")
NOISE_SEED_STEP = 7919       # repeat r > 0 draws its action noise from seed (protocol's) + r * step


def episode_keys(episodes: int, n_envs: int = EVAL_ENVS) -> list[tuple[int, int]]:
    """The protocol's episode keys (env i, k-th episode on env i) in its order: env i runs its
    quota of the evaluation's layout (``eval_quotas``)."""
    from flowrl_ray.envs.rollout import eval_quotas
    return sorted((i, k) for i, quota in enumerate(eval_quotas(episodes, n_envs)) for k in range(quota))


def initial_positions(cfg, episodes: int, seed: int = EVAL_SEED) -> list[list[float]]:
    """[E] the task object's initial world position (x, y, z) in each protocol episode: env i is
    reset with ``seed + EVAL_SEED_OFFSET + i`` and its k-th episode starts after k autoresets
    (the initial state does not depend on what ran before; tests/integration/test_protocol.py)."""
    import numpy as np

    from flowrl_ray.envs.robot import RobotEnv
    from flowrl_ray.envs.rollout import EVAL_SEED_OFFSET
    keys = episode_keys(episodes)
    out: dict[tuple[int, int], list[float]] = {}
    for i in sorted({i for i, _ in keys}):
        env = RobotEnv(cfg.env, None)
        try:
            env.reset(seed=seed + EVAL_SEED_OFFSET + i)
            for k in range(sum(1 for j, _ in keys if j == i)):
                if k:
                    env.reset()
                out[(i, k)] = np.asarray(env.raw_obs()["object"][:3], float).tolist()
        finally:
            env.close()
    return [out[key] for key in keys]


def group_states(repeats) -> list[str]:
    """Per state, from its outcomes [R'] in the grouping repeats: never / sometimes / always."""
    import numpy as np
    y = np.asarray(repeats, float)
    return ["never" if row.max() == 0 else "always" if row.min() == 1 else "sometimes" for row in y]


def split_by_group(groups: list[str], base0, variant, n_boot: int = 10_000) -> dict:
    """Per group: its states, the base's success in repeat 0 and the variant's (mean over seeds)
    on them, and the difference with its 95 % bootstrap CI paired by state
    (``flowrl_ray.stats.paired_bootstrap_gain`` on the group's states). base0 [E], variant [S, E]."""
    import numpy as np

    from flowrl_ray.stats import paired_bootstrap_gain
    b, v = np.asarray(base0, float), np.asarray(variant, float).reshape(-1, len(base0))
    out = {}
    for g in GROUPS:
        m = np.array([x == g for x in groups])
        if m.any():
            ci = paired_bootstrap_gain(v[:, m], b[m], n_boot=n_boot)
            out[g] = {"states": int(m.sum()), "base": float(b[m].mean()), "variant": float(v[:, m].mean()),
                      "change": ci["gain"], "ci_low": ci["ci_low"], "ci_high": ci["ci_high"]}
    return out


def spearman(x, y) -> float:
    """Rank correlation (scipy's, ties at their mean rank); NaN when either side is constant."""
    import numpy as np
    from scipy.stats import spearmanr
    if np.ptp(np.asarray(x, float)) == 0 or np.ptp(np.asarray(y, float)) == 0:
        return float("nan")
    return float(spearmanr(x, y).statistic)


def plot(path: Path, pos, per_state, variants: dict, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from flowrl_ray.plotting import save_figure
    import numpy as np
    pos = np.asarray(pos)
    panels = [("base, success over the repeats", per_state)] + \
        [(f"{name}, success over its seeds", v) for name, v in variants.items()]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4), squeeze=False)
    for ax, (label, c) in zip(axes[0], panels):
        sc = ax.scatter(pos[:, 0], pos[:, 1], c=c, cmap="RdYlGn", vmin=0, vmax=1, s=28, edgecolors="k", linewidths=0.3)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("object x (m)")
        ax.set_ylabel("object y (m)")
        ax.set_aspect("equal", adjustable="datalim")
    fig.colorbar(sc, ax=axes[0].tolist(), shrink=0.8, label="success rate at the initial state")
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="the config whose base policy (algo.base_policy) and env are measured")
    p.add_argument("--repeats", type=int, default=4, help="evaluations R of the base, each with other action noise (>= 3)")
    p.add_argument("--episodes", type=int, default=100, help="initial states E (the protocol's episodes)")
    p.add_argument("--protocol", help="a robot_protocol.py result JSON on the same base and episodes: split its variants")
    p.add_argument("--base-from", metavar="RESULT.json",
                   help="this tool's earlier result on the same config and episodes: reuse its base outcomes and "
                        "positions (no evaluation), e.g. to split another protocol's variants")
    p.add_argument("--output", default="robot_initial_state")
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    if args.repeats < 3:
        p.error("--repeats must be >= 3 (repeat 0 is compared, repeats 1.. group the states)")
    import numpy as np

    from flowrl_ray.config import load_config
    from flowrl_ray.envs.rollout import EVAL_SEED_OFFSET
    from flowrl_ray.stats import state_share_ci
    cfg = load_config(args.config, [])
    protocol = None
    if args.protocol:
        protocol = json.loads(Path(args.protocol).read_text())
        bases = protocol["bases"]
        if len(bases) != 1:
            p.error(f"--protocol: {len(bases)} bases in {args.protocol}; one expected")
        pbase = next(iter(bases.values()))
        if pbase["path"] != cfg.algo.base_policy:
            p.error(f"--protocol: its base {pbase['path']} is not the config's {cfg.algo.base_policy}")
        if protocol["protocol"]["episodes"] != args.episodes or protocol["protocol"]["eval_seed"] != EVAL_SEED \
                or protocol["protocol"]["eval_envs"] != EVAL_ENVS:
            p.error("--protocol: other episodes, evaluation seed or env count than this tool's")
        if "random" not in pbase["outcomes"]:
            p.error("--protocol: no random-sampling outcomes in it")

    if args.base_from:
        prev = json.loads(Path(args.base_from).read_text())
        if (prev["base"], prev["episodes"], prev["repeats"]) != (cfg.algo.base_policy, args.episodes, args.repeats):
            p.error(f"--base-from: {args.base_from} measured {prev['base']} on {prev['episodes']} states x "
                    f"{prev['repeats']} repeats, not {cfg.algo.base_policy} on {args.episodes} x {args.repeats}")
        y, pos = np.asarray(prev["outcomes"], float).T, prev["positions"]
    else:
        policy = base_policy(cfg)
        runner = make_eval_runner(cfg, policy)
        outcomes = []
        try:
            for r in range(args.repeats):
                noise = None if r == 0 else EVAL_SEED + EVAL_SEED_OFFSET + r * NOISE_SEED_STEP
                ep = evaluate_episodes(policy, cfg, args.episodes, runner, label=f"base repeat {r}",
                                       rules=("random",), noise_seed=noise)["random"]
                outcomes.append(ep["successes"])
        finally:
            runner.close()
        y = np.asarray(outcomes, float).T                                 # [E, R]
        pos = initial_positions(cfg, args.episodes)
    share = state_share_ci(y)
    per_state = y.mean(axis=1)
    counts = {"always": int((y.min(1) == 1).sum()), "never": int((y.max(1) == 0).sum())}
    counts["sometimes"] = args.episodes - counts["always"] - counts["never"]
    corr = {axis: spearman(np.asarray(pos)[:, j], per_state) for j, axis in enumerate("xyz")}
    results = {"base": cfg.algo.base_policy, "env": cfg.env.id, "episodes": args.episodes, "repeats": args.repeats,
               "success_per_repeat": y.mean(axis=0).tolist(), "state_share": share, "states_by_group": counts,
               "rank_correlation_with_position": corr, "positions": pos, "outcomes": y.T.tolist(), "variants": {}}

    body = [f"## Results\n\nThe base `{cfg.algo.base_policy}` on the {args.episodes} initial states of the robot "
            f"protocol (evaluation seed {EVAL_SEED}, {EVAL_ENVS} envs), {args.repeats} times by random sampling, "
            f"each with its own action noise (repeat 0: the protocol's).\n"]
    body.append(md_table(["figure", "value"], [
        ["success per repeat", " / ".join(f"{x:.2f}" for x in y.mean(axis=0))],
        ["state share of the outcome variance, ICC(1) [95 % CI]",
         f"**{share['share']:.2f} [{share['ci_low']:.2f}, {share['ci_high']:.2f}]**"],
        [f"states solved in all {args.repeats} / in none / in some", f"{counts['always']} / {counts['never']} / {counts['sometimes']}"],
        ["rank correlation of per-state success with the object's x / y / z",
         " / ".join(f"{corr[a]:+.2f}" for a in "xyz")]]))
    variants_plot = {}
    if protocol is not None:
        pbase = next(iter(protocol["bases"].values()))["outcomes"]["random"]
        if [list(k) for k in episode_keys(args.episodes)] != [list(k) for k in pbase["keys"]]:
            raise SystemExit("--protocol: its episode keys differ from this tool's")
        same = int((np.asarray(pbase["successes"]) == y[:, 0]).sum())
        results["repeat0_matches_protocol"] = f"{same}/{args.episodes}"
        if same != args.episodes:
            raise SystemExit(f"repeat 0 reproduces {same} of the protocol base's {args.episodes} outcomes; "
                             "not the same base, episodes or code")
        groups = group_states(y[:, 1:])
        # the base's row averages as many outcomes per state as a variant has seeds (a mean of
        # fewer outcomes is noisier, which alone lowers a rank correlation)
        n_seeds = min(len(v["runs"]) for v in protocol["variants"].values())
        b_corr = [spearman(np.asarray(pos)[:, j], y[:, :min(n_seeds, args.repeats)].mean(axis=1)) for j in range(2)]
        rows, corr_rows = [], [[f"base (repeats 0-{min(n_seeds, args.repeats) - 1})", f"{b_corr[0]:+.2f}", f"{b_corr[1]:+.2f}"]]
        for name, v in protocol["variants"].items():
            succ = np.asarray([r["outcomes"]["random"]["successes"] for r in v["runs"]], float)   # [S, E]
            split = split_by_group(groups, y[:, 0], succ)
            vcorr = {axis: spearman(np.asarray(pos)[:, j], succ.mean(axis=0)) for j, axis in enumerate("xy")}
            results["variants"][name] = {"seeds": len(succ), "by_group": split, "rank_correlation_with_position": vcorr}
            variants_plot[name] = succ.mean(axis=0)
            corr_rows.append([name, f"{vcorr['x']:+.2f}", f"{vcorr['y']:+.2f}"])
            for g, fig in split.items():
                rows.append([name, len(succ), g, fig["states"], f"{fig['base']:.2f}", f"{fig['variant']:.2f}",
                             f"{100 * fig['change']:+.1f} [{100 * fig['ci_low']:+.1f}, {100 * fig['ci_high']:+.1f}]"])
        results["groups"] = groups
        body.append(f"\nThe variants of `{args.protocol}` (their seeds' protocol outcomes, random sampling) on the "
                    f"states grouped by the base's repeats 1-{args.repeats - 1} (repeat 0 reproduces the protocol's "
                    f"base outcomes: {same}/{args.episodes}); base and variant success within a group are both "
                    f"with the protocol's action noise:\n")
        body.append(md_table(["variant", "seeds", f"base solves the state in repeats 1-{args.repeats - 1}", "states",
                              "base success (repeat 0)", "variant success", "change [95 % CI], points"], rows))
        body.append("\nRank correlation of per-state success (a variant's: the mean over its seeds) with the "
                    "object's initial position:\n")
        body.append(md_table(["policy", "x", "y"], corr_rows))
    results_dir = Path(args.results_dir)
    png = results_dir / f"{args.output}.png"
    plot(png, pos, per_state, variants_plot,
         f"{cfg.env.id}: success by the object's initial position ({args.episodes} protocol states, random sampling)")
    body.append(f"\n![success by initial position]({png.name})\n")
    write_json(results_dir / f"{args.output}.json",
               {"revision": git_revision(), "command": command_line(), "machine": machine_info(), **results})
    write_results(args.output, f"How much the initial state decides the outcome: {cfg.env.id}", "\n".join(body),
                  results_dir=results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
