"""Speed of the batched evaluator (common.Simulators) against the plain loop it replaced, measured side by side.

Both run the same evaluation: `copies` x `episodes` episodes of a task, episode i starting from
env.reset(seed=eval_seed + i), one batched forward per time step. Copy c acts like the greedy policy of a dataset's
behaviour network but takes the next action where the time step's uniform u < 0.02 c (distinct policies that share
stretches of their episodes, as members do; --identical-copies: all greedy, as SPIBB's members on low-epsilon data,
which Simulators simulates once). The plain loop steps one gymnasium environment per episode through the wrappers
gym.make adds; Simulators uses the task's fast path (vectorised CartPole, Acrobot on arrays, LunarLanderSteps) and, for
comparison, gymnasium's environments stepped without their wrappers and, on LunarLander, LunarLanderSteps through Box2D's
Python interface. Every path must give the same returns (checked here); the ratios of environment steps per second to
the plain loop's are printed, best of --repeats alternated runs.

    python benchmark/evaluator.py --env-id LunarLander-v3            # needs datasets/LunarLander-v3_eps0.15.npz
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import common  # noqa: E402


@dataclass
class Args:
    env_id: str = "LunarLander-v3"
    """task"""
    epsilon: float = 0.15
    """the dataset whose behaviour network acts (greedily)"""
    copies: int = 5
    """policies evaluated side by side (the members of a process)"""
    episodes: int = 40
    """episodes per copy"""
    repeats: int = 3
    """alternated measurements of each path; the best is kept"""
    eval_seed: int = 10_000
    identical_copies: bool = False
    """every copy the same greedy policy"""


def plain_loop(env_id, act, copies, episodes, seed):
    """The evaluator before Simulators: one gymnasium environment per episode, gym.make's wrappers, still one
    batched forward per time step (its uniforms drawn as Simulators.run draws them)."""
    envs = [common.make_env(env_id) for _ in range(copies * episodes)]
    obs = np.stack([e.reset(seed=seed + i % episodes)[0] for i, e in enumerate(envs)]).astype(np.float32)
    returns, active, steps = np.zeros(len(envs)), np.ones(len(envs), bool), 0
    generator = torch.Generator().manual_seed(0)
    while active.any():
        u = torch.rand(episodes, generator=generator)
        actions = act(torch.from_numpy(obs).view(copies, episodes, -1), u).reshape(-1).numpy()
        for j in np.flatnonzero(active):
            o, r, term, trunc, _ = envs[j].step(int(actions[j]))
            obs[j], returns[j], active[j] = o, returns[j] + r, not (term or trunc)
            steps += 1
    return returns.reshape(copies, episodes), steps


def main(args: Args) -> None:
    torch.set_num_threads(1)
    for name in ("copies", "episodes", "repeats"):
        common.require(getattr(args, name) >= 1, f"--{name} must be at least 1, got {getattr(args, name)}")
    path = REPO / "datasets" / f"{args.env_id}_eps{args.epsilon:g}.npz"
    common.require(path.is_file(), f"{path} not found; python collect_data.py --env-id {args.env_id} --epsilon "
                   f"{args.epsilon:g}")
    with np.load(path, allow_pickle=False) as f:
        beta = common.behavior_policy({k: f[k] for k in f.files})
    rate = torch.zeros(args.copies, 1) if args.identical_copies else 0.02 * torch.arange(args.copies)[:, None]

    def act(obs, u):
        greedy = beta(obs.reshape(-1, obs.shape[-1])).argmax(-1).view(obs.shape[:-1])
        return torch.where(u < rate, (greedy + 1) % beta.layers[-1][1].shape[0], greedy)

    def simulators(path: str):
        sims = common.Simulators(args.env_id, args.copies, args.episodes, args.eval_seed)
        if path == "gymnasium":  # the generic path: gymnasium's environments stepped without their wrappers
            sims.lunar = None
        if path == "interface":
            sims.lunar.allow_direct = False
        return lambda: (sims.run(act, 0), None)

    paths = {"plain loop": lambda: plain_loop(args.env_id, act, args.copies, args.episodes, args.eval_seed)}
    if args.env_id not in ("CartPole-v1", "Acrobot-v1"):  # those two have no per-episode gymnasium path
        paths["Simulators, gymnasium environments"] = simulators("gymnasium")
    if args.env_id == "LunarLander-v3":
        paths["Simulators, Box2D's Python interface"] = simulators("interface")
    paths["Simulators"] = simulators("")
    best, reference, n_steps = {}, None, None
    for _ in range(args.repeats):
        for name, run in paths.items():
            start = time.perf_counter()
            returns, steps = run()
            best[name] = min(best.get(name, np.inf), time.perf_counter() - start)
            n_steps = n_steps or steps
            reference = returns if reference is None else reference
            common.require(np.array_equal(returns, reference), f"{name} gives other returns than the plain loop")
    print(f"{args.env_id}, {args.copies} x {args.episodes} episodes, {n_steps} environment steps, mean return "
          f"{reference.mean():.2f}; best of {args.repeats}, steps/s relative to the plain loop:")
    for name, seconds in best.items():
        print(f"  {name:36s} {best['plain loop'] / seconds:5.2f}")


if __name__ == "__main__":
    try:
        main(common.parse(Args))
    except BrokenPipeError:  # `| head`: stop quietly, as run_grid.py does
        common.quiet_stdout()
        sys.exit(0)
