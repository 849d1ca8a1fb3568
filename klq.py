"""KL-regularised Q-learning, "KL-Q" (Jaques et al. 2019, "Way off-policy batch deep RL"): the BRPO
paper's "KL-Q" baseline, with the known behaviour policy beta of the dataset as the prior.

Jaques et al.'s KL-control keeps the learned policy pi = softmax(Q(s, .)) close to a prior p by
adding a KL reward to every transition; here the prior is beta, which the dataset stores exactly:
    r_KL(s, a) = c * (log beta(a|s) - log pi(a|s))                                 (--kl-calc sample)
            or  -c * sum_a'' beta(a''|s) * (log beta(a''|s) - log pi(a''|s))       (--kl-calc integral)
    y = r + r_KL(s, a) + gamma * (1 - terminal) * max_a' Q_target(s', a')
with c = 0.1 (--kl-weight; the BRPO paper's final value) and pi computed from the ONLINE network at s
and treated as a constant (no gradient through the KL reward), as in the source.

Variant: the max backup ("KL-control Q"), not the log-sum-exp "Psi-learning" backup. Reasons: it is
the source's default (psi_learning is off unless asked for), the BRPO paper calls the baseline
"KL-regularized Q-learning", and only with the max backup does the method reduce exactly to the
offline DQN of this repository when the KL weight is 0 (a log-sum-exp backup stays soft at c = 0).
--kl-calc: "sample" (default, the source's default) uses the dataset action a, which is drawn from
beta, so it is a one-sample estimate of -KL(beta || pi); "integral" is that KL computed exactly over
all actions (the same direction as the source's integral form, F.kl_div(log pi, beta)).
Numerics: log pi is log_softmax(Q) (finite for any Q, unlike the source's softmax(Q).log()), and
log beta is log(max(beta, 1e-8)), so the exact zeros of beta at epsilon = 0 give a large finite
penalty, never inf or NaN (in "integral" they are multiplied by beta = 0 and vanish).
Evaluation: greedy with respect to Q (the KL reward is already folded into Q; no sampling).
Departs from the source in: the TD loss is the squared error of this repository's DQN (the source
defaults to smooth L1 with gradient value clipping at 1), and the shared settings are the BRPO paper's
(appendix "Hyperparameters"): FC(32)-FC(16), Adam lr 1e-3, batch 64, gamma 0.99, soft target update
tau = 0.5 every 500 updates. No Monte-Carlo dropout targets or model averaging (not used by BRPO).

    python klq.py --env-id CartPole-v1 --epsilon 0.15
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
from typing import Literal, Optional

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
    """Adam learning rate of the Q-network"""
    batch_size: int = 64
    """minibatch size"""
    gamma: float = 0.99
    """discount factor"""
    tau: float = 0.5
    """soft target update rate: target <- tau * online + (1 - tau) * target"""
    target_update_frequency: int = 500
    """updates between soft target updates"""
    eval_frequency: int = 1_000
    """updates between evaluations in the simulator"""
    eval_episodes: int = 40
    """episodes per evaluation, run side by side"""
    eval_seed: int = 10_000
    """evaluation episode i starts from env.reset(seed=eval_seed + i), the same at every evaluation"""
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
    kl_weight: float = 0.1
    """weight c of the KL reward (0 gives exactly the offline DQN target)"""
    kl_calc: Literal["sample", "integral"] = "sample"
    """KL reward: 'sample' = log beta(a|s) - log pi(a|s) at the dataset action; 'integral' = -KL(beta || pi)"""


def fail(msg: str) -> None:
    """One line on stderr, exit status 1, no traceback."""
    raise SystemExit(f"{Path(sys.argv[0]).name}: error: {msg}")


def check_args(args: Args) -> None:
    positive = ("total_steps", "batch_size", "target_update_frequency", "eval_frequency", "eval_episodes", "threads")
    for name in positive:
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0.0 <= args.epsilon <= 1.0:
        fail(f"--epsilon must lie in [0, 1], got {args.epsilon}")
    if not args.learning_rate > 0:
        fail(f"--learning-rate must be positive, got {args.learning_rate}")
    if not 0.0 <= args.gamma < 1.0:
        fail(f"--gamma must lie in [0, 1), got {args.gamma}")
    if not 0.0 < args.tau <= 1.0:
        fail(f"--tau must lie in (0, 1], got {args.tau}")
    if not (args.kl_weight >= 0.0 and np.isfinite(args.kl_weight)):
        fail(f"--kl-weight must be a finite number >= 0, got {args.kl_weight}")


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


class QNetwork(nn.Module):
    """FC(32)-FC(16), the architecture of every network in the paper."""

    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, n_actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


# Floor of beta inside the log: beta(a|s) is exactly 0 for every non-greedy action at epsilon = 0.
LOG_BETA_FLOOR = 1e-8


def safe_log(p: torch.Tensor) -> torch.Tensor:
    return torch.log(torch.clamp(p, min=LOG_BETA_FLOOR))


def kl_reward(q: torch.Tensor, actions: torch.Tensor, beta: torch.Tensor, kl_weight: float,
              kl_calc: str) -> torch.Tensor:
    """c * (log beta - log pi) at the taken action ("sample") or -c * KL(beta || pi) ("integral"), with
    pi = softmax(q); q [B, |A|] (no gradient wanted: pass it detached), beta [B, |A|], actions [B]."""
    log_pi = torch.log_softmax(q, 1)
    if kl_calc == "sample":
        return kl_weight * (safe_log(beta.gather(1, actions[:, None])) - log_pi.gather(1, actions[:, None])).squeeze(1)
    return -kl_weight * (beta * (safe_log(beta) - log_pi)).sum(1)


def klq_target(rewards: torch.Tensor, not_done: torch.Tensor, next_q_target: torch.Tensor, q: torch.Tensor,
               actions: torch.Tensor, beta: torch.Tensor, gamma: float, kl_weight: float, kl_calc: str) -> torch.Tensor:
    """y = r + r_KL(s, a) + gamma * (1 - terminal) * max_a' Q_target(s', a'). The KL reward is added only
    when the weight is non-zero, so kl_weight = 0 returns the DQN target bit for bit."""
    y = rewards + gamma * next_q_target.max(1).values * not_done
    if kl_weight != 0.0:
        y = y + kl_reward(q, actions, beta, kl_weight, kl_calc)
    return y


def evaluate(act, envs: list, seed: int) -> np.ndarray:
    """Undiscounted return of one episode per env; all episodes advance together so the policy
    runs one batched forward per time step. Episode i always starts from reset(seed=seed + i)."""
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


def greedy_policy(q_network: QNetwork):
    def act(obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return q_network(torch.from_numpy(obs)).argmax(1).numpy()
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
    q_network = QNetwork(ckpt["obs_dim"], ckpt["n_actions"])
    q_network.load_state_dict(ckpt["q_network"])
    returns = evaluate(greedy_policy(q_network), envs, args.eval_seed)
    print(f"{args.eval_checkpoint}: {env_id} return {returns.mean():.2f} +- {returns.std():.2f} over {len(returns)} episodes")


def dataset_statistics(q_network: QNetwork, obs: torch.Tensor, actions: torch.Tensor, beta: torch.Tensor) -> dict:
    """Final diagnostics over the whole batch (one forward): how far pi = softmax(Q) is from beta."""
    with torch.no_grad():
        q = q_network(obs)
        log_pi = torch.log_softmax(q, 1)
        return {"kl_beta_pi_mean": float((beta * (safe_log(beta) - log_pi)).sum(1).mean()),
                "kl_pi_beta_mean": float((log_pi.exp() * (log_pi - safe_log(beta))).sum(1).mean()),
                "greedy_agrees_with_batch": float((q.argmax(1) == actions).float().mean()),
                "greedy_agrees_with_behavior_greedy": float((q.argmax(1) == beta.argmax(1)).float().mean())}


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
    next_obs = torch.as_tensor(data["next_observations"])
    actions = torch.as_tensor(data["actions"])
    rewards = torch.as_tensor(data["rewards"])
    behavior_probs = torch.as_tensor(data["behavior_probs"])  # beta(.|s), the KL prior
    # Time-limit truncations (timeouts) are not terminal: we bootstrap through them.
    not_done = torch.as_tensor(1.0 - data["terminals"].astype(np.float32))

    q_network = QNetwork(obs_dim, n_actions)
    target_network = QNetwork(obs_dim, n_actions)
    target_network.load_state_dict(q_network.state_dict())
    # fused=True: the same Adam update, done by one kernel for all parameter tensors instead of a
    # Python loop over them (about 4x cheaper per step on CPU; the throughput target relies on it).
    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate, fused=True)
    eval_envs = [make_env(args.env_id) for _ in range(args.eval_episodes)]
    act = greedy_policy(q_network)

    evaluations, train_time, eval_time, start = [], 0.0, 0.0, time.time()
    block_start = time.perf_counter()
    for step in range(1, args.total_steps + 1):
        idx = torch.randint(len(actions), (args.batch_size,), generator=generator)
        batch_actions = actions[idx]
        q_all = q_network(obs[idx])
        with torch.no_grad():
            # pi = softmax of the online Q at s, a constant of the target (as in the source).
            td_target = klq_target(rewards[idx], not_done[idx], target_network(next_obs[idx]), q_all.detach(),
                                   batch_actions, behavior_probs[idx], args.gamma, args.kl_weight, args.kl_calc)
        q = q_all.gather(1, batch_actions[:, None]).squeeze(1)
        loss = F.mse_loss(q, td_target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        if step % args.target_update_frequency == 0:
            with torch.no_grad():
                for p, tp in zip(q_network.parameters(), target_network.parameters()):
                    tp.lerp_(p, args.tau)

        if writer and step % 100 == 0:
            writer.add_scalar("losses/td_loss", loss.item(), step)
            writer.add_scalar("losses/q_values", q.mean().item(), step)
            with torch.no_grad():
                writer.add_scalar("losses/kl_reward", kl_reward(q_all.detach(), batch_actions, behavior_probs[idx],
                                                                args.kl_weight, args.kl_calc).mean().item(), step)

        if step % args.eval_frequency == 0 or step == args.total_steps:
            now = time.perf_counter()
            train_time += now - block_start
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
        "dataset_path": str(dataset_path), "format_version": FORMAT_VERSION,
        "extra": dataset_statistics(q_network, obs, actions, behavior_probs),
    }
    if args.save_model:
        torch.save({"algorithm": Path(__file__).stem, "env_id": args.env_id, "obs_dim": obs_dim, "n_actions": n_actions,
                    "args": asdict(args), "q_network": q_network.state_dict()}, run_dir / "model.pt")
    write_json_atomic(run_dir / "result.json", result)
    if writer:
        writer.add_scalar("eval/final_score", final_score, args.total_steps)
        writer.close()
    print(f"final score {final_score:.1f} (behaviour {result['behavior_return']:.1f}); results in {run_dir}")


if __name__ == "__main__":
    main(tyro.cli(Args))
