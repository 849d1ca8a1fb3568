"""Behaviour cloning (BRPO paper's "BC" baseline): maximum likelihood of the batch's actions.

Policy network FC(32)-FC(16) with a softmax output (paper appendix, "Hyperparameters"), Adam
lr 1e-3, batch 64. BC estimates the behaviour policy itself, so evaluation *samples* from the
learned distribution by default: the paper's BC column matches the epsilon-greedy behaviour policy
at every epsilon (e.g. CartPole eps=1: 22.6 vs 21.9), which only a sampling policy can do. Use
--eval-greedy to act with the most likely action instead.

    python bc.py --env-id LunarLander-v3 --epsilon 0.05
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from torch.utils.tensorboard import SummaryWriter

REPO = Path(__file__).resolve().parent
FORMAT_VERSION = 1


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """name of this experiment (part of the run name)"""
    env_id: str = "CartPole-v1"
    """gymnasium environment id (CartPole-v1, Acrobot-v1, LunarLander-v3)"""
    epsilon: float = 0.15
    """exploration level of the behaviour policy that collected the dataset"""
    seed: int = 1
    """seed of network initialisation and minibatch sampling"""
    dataset_path: Optional[str] = None
    """batch dataset (.npz from collect_data.py); default datasets/<env-id>_eps<epsilon>.npz, created if missing"""
    total_steps: int = 100_000
    """gradient updates (the paper does not state its number; 100k is our documented default)"""
    learning_rate: float = 1e-3
    """Adam learning rate of the policy network"""
    batch_size: int = 64
    """minibatch size"""
    eval_frequency: int = 1_000
    """updates between evaluations in the simulator"""
    eval_episodes: int = 40
    """episodes per evaluation, run side by side"""
    eval_seed: int = 10_000
    """evaluation episode i starts from env.reset(seed=eval_seed + i), the same at every evaluation"""
    eval_greedy: bool = False
    """act with the most likely action instead of sampling from the cloned policy"""
    runs_dir: str = "runs"
    """directory holding one sub-directory per run"""
    run_name: Optional[str] = None
    """sub-directory name of this run; default <env>__eps<eps>__<exp>__<seed>__<time>"""
    tensorboard: bool = True
    """write TensorBoard curves to runs/<run-name>/"""
    save_model: bool = False
    """save runs/<run-name>/model.pt, which --eval-checkpoint can evaluate on its own"""
    eval_checkpoint: Optional[str] = None
    """evaluate this saved model.pt (no training, no dataset) and exit"""
    threads: int = 1
    """torch intra-op threads (tiny MLPs run fastest on one)"""


def fail(msg: str) -> None:
    """One line on stderr, exit status 1, no traceback."""
    raise SystemExit(f"{Path(sys.argv[0]).name}: error: {msg}")


def check_args(args: Args) -> None:
    positive = ("total_steps", "batch_size", "eval_frequency", "eval_episodes", "threads")
    for name in positive:
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0.0 <= args.epsilon <= 1.0:
        fail(f"--epsilon must lie in [0, 1], got {args.epsilon}")
    if not args.learning_rate > 0:
        fail(f"--learning-rate must be positive, got {args.learning_rate}")


def make_env(env_id: str) -> gym.Env:
    if env_id == "LunarLander-v2":
        fail("LunarLander-v2 is not registered in gymnasium 1.x; use --env-id LunarLander-v3")
    try:
        env = gym.make(env_id, disable_env_checker=True)
    except gym.error.Error as e:
        fail(f"cannot make environment {env_id!r}: {e}")
    except ModuleNotFoundError as e:
        fail(f"environment {env_id!r} needs a missing package ({e}); pip install 'gymnasium[box2d]'")
    if not isinstance(env.action_space, gym.spaces.Discrete):
        fail(f"{env_id} has a {type(env.action_space).__name__} action space; only discrete actions are supported")
    return env


def load_dataset(args: Args, obs_dim: int, n_actions: int) -> tuple[Path, dict]:
    """Read and validate the batch; a missing *default* dataset is created with collect_data.py."""
    path = Path(args.dataset_path) if args.dataset_path else REPO / "datasets" / f"{args.env_id}_eps{args.epsilon:g}.npz"
    how = f"python collect_data.py --env-id {args.env_id} --epsilon {args.epsilon:g} --overwrite" + (
        f" --dataset-path {path}" if args.dataset_path else "")
    if not path.exists():
        if args.dataset_path:
            fail(f"dataset {path} not found; create it with: {how}")
        print(f"dataset {path} not found: creating it from the committed behaviour policy", flush=True)
        cmd = [sys.executable, str(REPO / "collect_data.py"), "--env-id", args.env_id, "--epsilon", f"{args.epsilon:g}"]
        if subprocess.run(cmd).returncode != 0:
            fail(f"could not create dataset {path} (see the collect_data.py message above)")
    keys = ("observations", "actions", "rewards", "next_observations", "terminals", "timeouts",
            "behavior_probs", "next_behavior_probs", "epsilon", "env_id", "behavior_return", "format_version")
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = [k for k in keys if k not in f.files]
            if missing:
                fail(f"dataset {path} lacks {missing}: it was not written by collect_data.py; recreate it with: {how}")
            d = {k: f[k] for k in keys}
    except SystemExit:
        raise
    except Exception as e:  # truncated or corrupt zip, bad pickle-free array, I/O error
        fail(f"dataset {path} is unreadable ({type(e).__name__}: {e}); it is corrupt or truncated, recreate it with: {how}")
    if int(d["format_version"]) != FORMAT_VERSION:
        fail(f"dataset {path} has format version {int(d['format_version'])}, expected {FORMAT_VERSION}; recreate it with: {how}")
    if str(d["env_id"]) != args.env_id:
        fail(f"dataset {path} was recorded on {d['env_id']}, not {args.env_id}; pass --env-id {d['env_id']} or another dataset")
    if not np.isclose(float(d["epsilon"]), args.epsilon):
        fail(f"dataset {path} was collected with epsilon {float(d['epsilon']):g}, not {args.epsilon:g}; pass --epsilon {float(d['epsilon']):g}")
    n = len(d["actions"])
    shapes = {"observations": (n, obs_dim), "next_observations": (n, obs_dim), "rewards": (n,), "terminals": (n,),
              "timeouts": (n,), "behavior_probs": (n, n_actions), "next_behavior_probs": (n, n_actions)}
    for k, shape in shapes.items():
        if d[k].shape != shape:
            fail(f"dataset {path}: {k} has shape {d[k].shape}, expected {shape} for {args.env_id} "
                 f"(observation size {obs_dim}, {n_actions} actions); was it recorded on another task?")
    if n == 0:
        fail(f"dataset {path} is empty; recreate it with: {how}")
    for k in ("observations", "next_observations", "rewards", "behavior_probs", "next_behavior_probs"):
        if not np.isfinite(d[k]).all():
            fail(f"dataset {path}: {k} contains NaN or inf ({np.count_nonzero(~np.isfinite(d[k]))} values); recreate it with: {how}")
    if d["actions"].min() < 0 or d["actions"].max() >= n_actions:
        fail(f"dataset {path}: actions outside [0, {n_actions}); was it recorded on another task?")
    for k in ("behavior_probs", "next_behavior_probs"):
        if (d[k] < 0).any() or not np.allclose(d[k].sum(1), 1.0, atol=1e-4):
            fail(f"dataset {path}: {k} rows are not probability distributions; recreate it with: {how}")
    return path, d


class PolicyNetwork(nn.Module):
    """FC(32)-FC(16) producing action logits, the architecture of every network in the paper."""

    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, n_actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def evaluate(act, envs: list, seed: int) -> np.ndarray:
    """Undiscounted return of one episode per env; all episodes advance together so the policy
    runs one batched forward per time step. Episode i always starts from reset(seed=seed + i)."""
    if hasattr(act, "reset"):
        act.reset()
    obs = np.stack([env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]).astype(np.float32)
    returns, active = np.zeros(len(envs)), np.ones(len(envs), dtype=bool)
    while active.any():
        idx = np.flatnonzero(active)
        for j, a in zip(idx, act(obs[idx]).tolist()):
            o, r, term, trunc, _ = envs[j].step(a)
            obs[j], returns[j] = o, returns[j] + r
            active[j] = not (term or trunc)
    return returns


def write_json_atomic(path: Path, obj: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the file from other users
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def make_policy(policy_network: PolicyNetwork, greedy: bool, seed: int):
    """Acting function for evaluate(). The sampling noise of the evaluation after k updates starts from
    seed + k (act.n_updates = k): each evaluation is reproducible on its own (a checkpoint re-evaluates to
    the same returns), and the last 10 evaluations that make the final score average 10 independent draws
    of the policy's randomness, like the behaviour policy's 10 passes in `behavior_return`."""
    generator = torch.Generator()

    def act(obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            logits = policy_network(torch.from_numpy(obs))
            if greedy:
                return logits.argmax(1).numpy()
            return torch.multinomial(torch.softmax(logits, 1), 1, generator=generator).squeeze(1).numpy()

    act.n_updates = 0
    act.reset = lambda: generator.manual_seed(seed + act.n_updates)
    return act


def run_checkpoint(args: Args) -> None:
    try:
        ckpt = torch.load(args.eval_checkpoint, map_location="cpu", weights_only=True)
        env_id = ckpt["env_id"]
    except FileNotFoundError:
        fail(f"checkpoint {args.eval_checkpoint} not found")
    except Exception as e:
        fail(f"checkpoint {args.eval_checkpoint} is unreadable ({type(e).__name__}: {e})")
    if ckpt.get("algorithm") != Path(__file__).stem:
        fail(f"checkpoint {args.eval_checkpoint} was saved by {ckpt.get('algorithm')}.py, not {Path(__file__).name}")
    envs = [make_env(env_id) for _ in range(args.eval_episodes)]
    policy_network = PolicyNetwork(ckpt["obs_dim"], ckpt["n_actions"])
    policy_network.load_state_dict(ckpt["policy_network"])
    act = make_policy(policy_network, args.eval_greedy, args.eval_seed)
    act.n_updates = ckpt.get("n_updates", 0)  # the sampling noise of the run's own evaluation at that point
    returns = evaluate(act, envs, args.eval_seed)
    print(f"{args.eval_checkpoint}: {env_id} return {returns.mean():.2f} +- {returns.std():.2f} over {len(returns)} episodes")


def main(args: Args) -> None:
    check_args(args)
    torch.set_num_threads(args.threads)
    if args.eval_checkpoint:
        return run_checkpoint(args)
    env = make_env(args.env_id)
    obs_dim, n_actions = env.observation_space.shape[0], int(env.action_space.n)
    dataset_path, data = load_dataset(args, obs_dim, n_actions)

    # Everything is validated: only now create outputs.
    run_name = args.run_name or f"{args.env_id}__eps{args.epsilon:g}__{args.exp_name}__{args.seed}__{int(time.time())}"
    run_dir = Path(args.runs_dir) / run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    writer = SummaryWriter(str(run_dir)) if args.tensorboard else None
    if writer:
        writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))

    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    obs = torch.as_tensor(data["observations"])
    actions = torch.as_tensor(data["actions"])

    policy_network = PolicyNetwork(obs_dim, n_actions)
    # fused: one kernel for the whole Adam step, ~4x cheaper than the default per-parameter loop.
    optimizer = torch.optim.Adam(policy_network.parameters(), lr=args.learning_rate, fused=True)
    eval_envs = [make_env(args.env_id) for _ in range(args.eval_episodes)]
    act = make_policy(policy_network, args.eval_greedy, args.eval_seed)

    evaluations, train_time, eval_time, start = [], 0.0, 0.0, time.time()
    block_start = time.perf_counter()
    for step in range(1, args.total_steps + 1):
        idx = torch.randint(len(actions), (args.batch_size,), generator=generator)
        logits = policy_network(obs[idx])
        loss = F.cross_entropy(logits, actions[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        if writer and step % 100 == 0:
            writer.add_scalar("losses/nll", loss.item(), step)

        if step % args.eval_frequency == 0 or step == args.total_steps:
            now = time.perf_counter()
            train_time += now - block_start
            act.n_updates = step
            returns = evaluate(act, eval_envs, args.eval_seed)
            block_start = time.perf_counter()
            eval_time += block_start - now
            evaluations.append({"step": step, "return_mean": float(returns.mean()), "return_std": float(returns.std())})
            sps = step / train_time
            print(f"step={step} eval_return={returns.mean():.1f} +- {returns.std():.1f} SPS={sps:.0f}", flush=True)
            if writer:
                writer.add_scalar("eval/episodic_return", returns.mean(), step)
                writer.add_scalar("charts/SPS", sps, step)

    final_score = float(np.mean([e["return_mean"] for e in evaluations[-10:]]))
    result = {
        "algorithm": Path(__file__).stem, "env_id": args.env_id, "epsilon": args.epsilon, "seed": args.seed,
        "args": asdict(args), "evaluations": evaluations, "final_score": final_score,
        "behavior_return": float(data["behavior_return"]), "wall_time": time.time() - start,
        "train_time": train_time, "eval_time": eval_time, "updates_per_second": args.total_steps / train_time,
        "dataset_path": str(dataset_path), "format_version": FORMAT_VERSION, "extra": {},
    }
    if args.save_model:
        torch.save({"algorithm": Path(__file__).stem, "env_id": args.env_id, "obs_dim": obs_dim, "n_actions": n_actions,
                    "args": asdict(args), "policy_network": policy_network.state_dict(), "n_updates": args.total_steps},
                   run_dir / "model.pt")
    write_json_atomic(run_dir / "result.json", result)
    if writer:
        writer.add_scalar("eval/final_score", final_score, args.total_steps)
        writer.close()
    print(f"final score {final_score:.1f} (behaviour {result['behavior_return']:.1f}); results in {run_dir}")


if __name__ == "__main__":
    main(tyro.cli(Args))
