"""Training throughput of every algorithm script, M runs trained as members of one process, next to a minimal
torch DQN update loop.

Both are measured in this one run, on this machine, one torch thread each:
  * reference: the plainest DQN update (FC(32)-FC(16), batch 64, Adam, MSE TD loss) on tensors
    already in memory -- what "as fast as the hardware allows" means for one of these tiny networks;
  * each script with --seeds 1..M: run as a subprocess with a small budget; its result.json reports the updates/s
    of its training loop (evaluation excluded), which every member makes: M times that is the per-member rate.
The ratio printed is the per-member update rate over the reference's. Then the share of wall time spent in
evaluation, from member runs with the default evaluation settings (every 1,000 updates, 40 episodes).

    python benchmark/throughput.py                     # all scripts, CartPole-v1 eps 0.15, M = 1, 5, 25
    python benchmark/throughput.py --scripts brpo.py --env-id Acrobot-v1 --members 25
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = ("dqn_offline.py", "bc.py", "brpo_c.py", "brpo.py", "bcq_discrete.py", "klq.py", "spibb.py", "cql_discrete.py")
# Targets: per-member update rate over the reference loop's, by number of members M, from the project issues;
# cql_discrete.py's are ours (no issue sets them): dqn_offline.py's, as its update is that plus one log-sum-exp.
TARGETS = {"dqn_offline.py": {1: 0.9, 5: 4, 25: 10}, "bc.py": {1: 0.9, 5: 4, 25: 10},
           "brpo.py": {1: 0.4, 25: 3}, "brpo_c.py": {1: 0.7, 5: 4, 25: 10},
           "bcq_discrete.py": {1: 0.8, 5: 4, 25: 10}, "klq.py": {1: 0.8, 5: 4, 25: 10}, "spibb.py": {1: 0.8, 5: 4, 25: 10},
           "cql_discrete.py": {1: 0.9, 5: 4, 25: 10}}


@dataclass
class Args:
    env_id: str = "CartPole-v1"
    """environment whose dataset the scripts train on"""
    epsilon: float = 0.15
    """dataset exploration level"""
    scripts: tuple[str, ...] = SCRIPTS
    """algorithm scripts to measure (missing ones are reported and skipped)"""
    members: tuple[int, ...] = (1, 5, 25)
    """numbers of members (seeds 1..M in one process) to measure"""
    updates: int = 5_000
    """updates per throughput measurement"""
    repeats: int = 3
    """measurements per script and of the reference; the best is kept (least disturbed by the OS)"""
    eval_share_steps: int = 10_000
    """updates of the member run (the largest --members) that measures the evaluation share (0 skips it)"""
    reference_only: bool = False
    """internal: print the reference loop's updates/s for this environment and exit"""


def reference_updates_per_second(obs_dim: int, n_actions: int, n: int) -> float:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch.manual_seed(0)
    N = 100_000
    obs, next_obs = torch.randn(N, obs_dim), torch.randn(N, obs_dim)
    actions, rewards, dones = torch.randint(n_actions, (N,)), torch.randn(N), torch.zeros(N)

    def mlp():
        return nn.Sequential(nn.Linear(obs_dim, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, n_actions))

    q, target = mlp(), mlp()
    opt = torch.optim.Adam(q.parameters(), lr=1e-3)
    start = None
    for i in range(n + 200):
        if i == 200:  # warm-up excluded
            start = time.perf_counter()
        idx = torch.randint(N, (64,))
        with torch.no_grad():
            y = rewards[idx] + 0.99 * target(next_obs[idx]).max(1).values * (1 - dones[idx])
        loss = F.mse_loss(q(obs[idx]).gather(1, actions[idx, None]).squeeze(1), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return n / (time.perf_counter() - start)


def reference_in_subprocess(args: Args) -> float:
    cmd = [sys.executable, __file__, "--env-id", args.env_id, "--updates", str(args.updates), "--reference-only"]
    return float(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip())


def run_script(script: str, args: Args, members: int, steps: int, eval_frequency: int, eval_episodes: int,
               out: Path) -> dict | None:
    """The result.json of the first member of a run of `members` seeds in one process."""
    name = f"{Path(script).stem}_{members}_{steps}_{eval_frequency}"
    cmd = [sys.executable, str(REPO / script), "--env-id", args.env_id, "--epsilon", f"{args.epsilon:g}",
           "--seeds", *map(str, range(1, members + 1)), "--total-steps", str(steps), "--eval-frequency",
           str(eval_frequency), "--eval-episodes", str(eval_episodes), "--runs-dir", str(out), "--run-name",
           name + "/{seed}", "--no-tensorboard", "--threads", "1", "--overwrite"]
    proc = subprocess.run(cmd, capture_output=True, text=True)  # --overwrite: repeats reuse the run names
    if proc.returncode != 0:
        print(f"  {script} failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
        return None
    return json.loads((out / name / "1" / "result.json").read_text())


def check_args(args: Args) -> None:
    """One line and exit 1 on a bad flag, before any dataset is made or anything is timed."""
    def fail(msg):
        raise SystemExit(f"throughput.py: error: {msg}")
    if args.env_id not in ("CartPole-v1", "Acrobot-v1", "LunarLander-v3"):  # the tasks with a behaviour network
        fail(f"--env-id must be CartPole-v1, Acrobot-v1 or LunarLander-v3, got {args.env_id}")
    if args.epsilon not in (0.05, 0.15, 0.25, 0.5, 1.0):
        fail(f"--epsilon must be one of the datasets' 0.05, 0.15, 0.25, 0.5, 1, got {args.epsilon:g}")
    for name in ("updates", "repeats"):
        if getattr(args, name) < 1:
            fail(f"--{name} must be at least 1, got {getattr(args, name)}")
    if not args.members or min(args.members) < 1:
        fail(f"--members must be at least 1 each, got {args.members}")
    if args.eval_share_steps < 0:
        fail(f"--eval-share-steps must be >= 0, got {args.eval_share_steps}")


def main(args: Args) -> None:
    import gymnasium as gym

    check_args(args)
    env = gym.make(args.env_id)
    obs_dim, n_actions = env.observation_space.shape[0], env.action_space.n
    if args.reference_only:
        print(reference_updates_per_second(obs_dim, n_actions, args.updates))
        return
    present = [s for s in args.scripts if (REPO / s).exists()]
    for s in sorted(set(args.scripts) - set(present)):
        print(f"{s}: not in the repository yet, skipped")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        # Make sure the dataset exists before timing anything.
        subprocess.run([sys.executable, str(REPO / "collect_data.py"), "--env-id", args.env_id,
                        "--epsilon", f"{args.epsilon:g}"], check=True, capture_output=True)
        rows = []
        for script in present:
            for m in args.members:
                # Alternate reference and script, each in a fresh process, and keep the best of each:
                # interference from other processes only ever slows a measurement down.
                refs, results = [], []
                for _ in range(args.repeats):
                    refs.append(reference_in_subprocess(args))
                    results.append(run_script(script, args, m, args.updates, args.updates, 1, out))
                if any(r is None for r in results):
                    continue
                rows.append((script, m, m * max(r["updates_per_second"] for r in results), max(refs)))
        print(f"\ntraining throughput on {args.env_id} eps {args.epsilon:g} (member-updates/s, one thread; reference = "
              f"minimal torch DQN update, best of {args.repeats} fresh processes alternated with the script's)")
        print(f"{'script':<18}{'M':>4}{'updates/s':>11}{'reference':>11}{'ratio':>8}{'target':>8}  ok")
        for script, m, ups, ref in rows:
            t = TARGETS.get(script, {}).get(m)
            verdict = "-" if t is None else "yes" if ups / ref >= t else "NO"
            print(f"{script:<18}{m:>4}{ups:>11.0f}{ref:>11.0f}{ups / ref:>8.2f}{'' if t is None else f'{t:.1f}':>8}  "
                  f"{verdict}")
        if args.eval_share_steps:
            m = max(args.members)
            print(f"\nevaluation share of wall time ({m} members, {args.eval_share_steps} updates, evaluation every 1000 "
                  f"updates over 40 episodes; target <= 20%)")
            for script in present:
                r = run_script(script, args, m, args.eval_share_steps, 1_000, 40, out)
                if r:
                    share = r["eval_time"] / r["wall_time"]
                    print(f"{script:<18}eval {r['eval_time']:6.1f}s of {r['wall_time']:6.1f}s = {100 * share:5.1f}%  "
                          f"{'ok' if share <= 0.20 else 'OVER'}  (final return of seed 1 {r['final_score']:.1f})")


if __name__ == "__main__":
    try:
        main(tyro.cli(Args))
    except BrokenPipeError:  # `| head`: stop quietly, as run_grid.py does (stdout to /dev/null: the exit's flush)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
