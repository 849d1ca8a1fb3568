"""Behaviour policies and epsilon-greedy batch datasets (BRPO paper, "Experimental Details").

Protocol (paper, appendix "Behavior policy" and section "Experimental Results"):
  * the behaviour policy is a DQN with an FC(32)-FC(16) MLP, replay buffer 500,000, batch 64,
    trained 50,000 environment steps on CartPole-v1 / Acrobot-v1 and 100,000 on LunarLander;
  * each dataset holds 100,000 transitions of the epsilon-greedy behaviour policy, for
    epsilon in {0.05, 0.15, 0.25, 0.5, 1.0}; the behaviour policy is known:
        beta(a|s) = (1 - eps) * 1[a == argmax_a Q_b(s, a)] + eps / |A|.

The trained behaviour networks are committed under `behavior_policies/` so that every machine
regenerates the same datasets; `--train-behavior` retrains them (see `train_behavior`).

    python collect_data.py --env-id CartPole-v1                 # all five epsilons
    python collect_data.py --env-id Acrobot-v1 --epsilon 0.15   # one dataset
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

if __name__ == "__main__":  # an interrupt while the libraries below load has nothing to clean up: one line, exit 130
    def _interrupted(*_):
        print(f"{Path(sys.argv[0]).name}: interrupted; no partial dataset was kept", file=sys.stderr)
        os._exit(130)
    signal.signal(signal.SIGINT, _interrupted)
    signal.signal(signal.SIGTERM, _interrupted)

import gymnasium as gym
import numpy as np

import common  # the scripts' evaluator and defaults, which score beta's return

FORMAT_VERSION = 2  # docs/formats.md
REPO = Path(__file__).resolve().parent
PAPER_EPSILONS = (0.05, 0.15, 0.25, 0.5, 1.0)
# Behaviour training budget in environment steps (paper appendix "Behavior policy").
PAPER_TRAIN_STEPS = {"CartPole-v1": 50_000, "Acrobot-v1": 50_000, "LunarLander-v3": 100_000}
# The paper trains "until the performance reaches around 75% of the optimal performance"; what it
# actually reports for its behaviour policies (Table 1, eps = 0.05 column) is the concrete target
# we select a checkpoint for, so that our datasets sit in the paper's regime.
PAPER_BEHAVIOR_RETURN_EPS005 = {"CartPole-v1": 219.1, "Acrobot-v1": -103.9, "LunarLander-v3": 73.7}
# Share of behaviour training over which exploration decays from 1 to 0.05 (the paper does not say).
# LunarLander's 100k-step budget only suffices with a short decay (12%, as in tuned DQN settings
# for this task); with 50% the agent ends up hovering until the time limit.
EXPLORATION_FRACTION = {"LunarLander-v3": 0.12}
# Seeds of the committed behaviour networks. On LunarLander, seed 1 ends in a policy that hovers until
# the time limit (-16 at eps=0.05); seed 2 lands (61 at eps=0.05, paper: 73.7).
BEHAVIOR_TRAIN_SEED = {"CartPole-v1": 1, "Acrobot-v1": 1, "LunarLander-v3": 2}
# Episodes scoring each behaviour checkpoint; LunarLander's returns are bimodal (land or crash), so
# fewer episodes pick checkpoints on noise.
SELECTION_EPISODES = 50
DATASET_KEYS = (
    "observations", "actions", "rewards", "next_observations", "terminals", "timeouts",
    "behavior_probs", "next_behavior_probs", "behavior_w0", "behavior_b0", "behavior_w1",
    "behavior_b1", "behavior_w2", "behavior_b2", "epsilon", "env_id", "behavior_return",
    "behavior_return_std", "format_version", "settings_json", "behavior_kind", "behavior_temperature",
    "behavior_floor",
)


@dataclass
class Args:
    env_id: str = "CartPole-v1"
    """gymnasium environment id (CartPole-v1, Acrobot-v1, LunarLander-v3)"""
    epsilon: tuple[float, ...] = PAPER_EPSILONS
    """exploration level(s) of the epsilon-greedy behaviour policy; one dataset per value"""
    seed: int = 0
    """seed of the data collection (environment resets and exploration noise)"""
    num_transitions: int = 100_000
    """transitions per dataset (paper: 100K)"""
    dataset_path: Optional[str] = None
    """output file (only with a single --epsilon); default datasets/<env-id>_eps<epsilon>.npz"""
    behavior_path: Optional[str] = None
    """behaviour network file; default behavior_policies/<env-id>.npz (committed)"""
    behavior_eval_episodes: int = 40
    """start states of the behaviour-return measurement: episode i starts from reset(seed=eval_seed + i), the
    start states on which the algorithm scripts are scored (their default --eval-episodes 40, --eval-seed 10000)"""
    behavior_eval_passes: int = 10
    """passes over those start states, with the exploration noise of the scripts' last evaluations (their final score
    averages the last 10); behavior_return is the mean of the passes' means, as a final score is (400 episodes)"""
    eval_seed: int = 10_000
    """seed of the first measurement episode (episode i uses eval_seed + i)"""
    overwrite: bool = False
    """rewrite datasets that already exist (otherwise they are kept), and let --train-behavior replace its file"""
    train_behavior: bool = False
    """retrain the behaviour DQN into --behavior-path (an existing file only with --overwrite) instead of using the
    committed one"""
    behavior_train_steps: Optional[int] = None
    """environment steps of behaviour training; default: the paper's (50k, 50k, 100k)"""
    behavior_train_seed: Optional[int] = None
    """seed of behaviour training; default: the seed of the committed network (BEHAVIOR_TRAIN_SEED)"""


# ---------------------------------------------------------------------------------------------
# Errors: one line, non-zero exit, nothing half-written.
fail = common.fail


def make_env(env_id: str) -> gym.Env:
    return common.make_env(env_id, "This script collects in a gymnasium task's simulator; import logs of another "
                           "task with import_data.py")


def default_dataset_path(env_id: str, epsilon: float) -> Path:
    return REPO / "datasets" / f"{env_id}_eps{epsilon:g}.npz"


def atomic_savez(path: Path, **arrays) -> None:
    """Write an .npz so that readers see either nothing or the complete file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the file from other users
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ---------------------------------------------------------------------------------------------
# The behaviour network, evaluated in float64 numpy so that the greedy action used for acting and
# the stored beta(.|s) agree exactly (float32 near-ties could otherwise flip the argmax).
def q_values(weights: dict, obs: np.ndarray) -> np.ndarray:
    h = np.maximum(obs @ weights["w0"].T.astype(np.float64) + weights["b0"], 0.0)
    h = np.maximum(h @ weights["w1"].T.astype(np.float64) + weights["b1"], 0.0)
    return h @ weights["w2"].T.astype(np.float64) + weights["b2"]


def behavior_probs(weights: dict, obs: np.ndarray, epsilon: float) -> np.ndarray:
    q = q_values(weights, np.asarray(obs, dtype=np.float64))
    n_actions = q.shape[-1]
    probs = np.full(q.shape, epsilon / n_actions)
    probs[np.arange(len(q)), q.argmax(-1)] += 1.0 - epsilon
    return probs


def numpy_simd() -> list:
    """The CPU extensions numpy dispatches to: gymnasium's Acrobot rounds an observation differently on a machine
    with others (docs/benchmark.md, "Reproducibility"), so the dataset records them."""
    try:  # the baseline numpy was built for, then what it found on this CPU
        simd = np.show_config(mode="dicts")["SIMD Extensions"]
        return list(simd["baseline"]) + list(simd["found"])
    except Exception:  # noqa: BLE001  (numpy < 1.26 has no mode="dicts"): a record, never a reason to fail
        return []


def run_episodes(env_id: str, weights: dict, epsilon: float, n: int, seed: int) -> np.ndarray:
    """Returns of n epsilon-greedy episodes, run side by side (one batched forward per step); episode i starts
    from reset(seed=seed + i), the exploration noise from a generator seeded with seed (behaviour training's
    checkpoint selection; behavior_returns scores the datasets' beta)."""
    envs = [make_env(env_id) for _ in range(n)]
    rng = np.random.default_rng(seed)
    obs = np.stack([env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]).astype(np.float64)
    returns, active = np.zeros(n), np.ones(n, dtype=bool)
    while active.any():
        idx = np.flatnonzero(active)
        greedy = q_values(weights, obs[idx]).argmax(-1)
        explore = rng.random(len(idx)) < epsilon
        actions = np.where(explore, rng.integers(envs[0].action_space.n, size=len(idx)), greedy)
        for j, a in zip(idx, actions):
            o, r, term, trunc, _ = envs[j].step(int(a))
            obs[j], returns[j] = o, returns[j] + r
            active[j] = not (term or trunc)
    return returns


DEFAULTS = common.RunArgs()
MAX_BEHAVIOR_PASSES = DEFAULTS.total_steps // DEFAULTS.eval_frequency  # evaluations of the scripts' default schedule


def behavior_noise_steps(passes: int) -> list[int]:
    """The updates whose evaluation noise (seed eval_seed + step) the behaviour return's passes use: the last ones
    of the scripts' default schedule, which their final score averages (the last 10)."""
    return [DEFAULTS.total_steps - DEFAULTS.eval_frequency * (passes - 1 - p) for p in range(passes)]


def behavior_returns(env_id: str, weights: dict, epsilon: float, episodes: int, passes: int, eval_seed: int) -> np.ndarray:
    """beta's returns [passes, episodes] as the algorithm scripts score a policy: their evaluator (common.Simulators,
    actions drawn by common.sample from beta in float64), their start states, and the exploration noise of their last
    `passes` evaluations (behavior_noise_steps). With the scripts' default schedule, --eval-episodes and --eval-seed
    and sampled evaluation, a run that deploys beta over its last 10 evaluations scores the mean of these passes'
    means (docs/experiments/2026-12-03-paired-behaviour.md)."""
    # the float32 weights the dataset stores, which the scripts' BehaviorPolicy reads
    policy = common.BehaviorPolicy({k: np.asarray(v, np.float32) for k, v in weights.items()}, epsilon)
    simulators = common.Simulators(env_id, 1, episodes, eval_seed)
    act = lambda obs, u: common.sample(policy(obs.reshape(-1, obs.shape[-1])).view(*obs.shape[:-1], -1), u.double())  # noqa: E731
    return np.stack([simulators.run(act, eval_seed + step)[0] for step in behavior_noise_steps(passes)])


# ---------------------------------------------------------------------------------------------
def train_behavior(env_id: str, steps: int, seed: int, path: Path, eval_seed: int) -> None:
    """Online DQN with the paper's settings; keeps the checkpoint closest to the paper's behaviour.

    FC(32)-FC(16), Adam lr 1e-3, batch 64, replay 500,000, gamma 0.99, soft target update 0.5
    every 500 steps (paper hyperparameter table), exploration decaying linearly from 1 to 0.05 over
    the first half of training (EXPLORATION_FRACTION for exceptions).
    Every 2,500 steps the eps=0.05 policy is scored on 50 episodes; the checkpoint whose score is
    closest to the paper's reported eps=0.05 behaviour return is saved, which is how we read
    "trained until it reaches around 75% of optimal".
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    env = make_env(env_id)
    obs_dim, n_actions = env.observation_space.shape[0], env.action_space.n
    net = nn.Sequential(nn.Linear(obs_dim, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, n_actions))
    target = copy.deepcopy(net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    size = min(500_000, steps)
    buf_o = np.zeros((size, obs_dim), np.float32)
    buf_o2, buf_a = np.zeros_like(buf_o), np.zeros(size, np.int64)
    buf_r, buf_d = np.zeros(size, np.float32), np.zeros(size, np.float32)
    rng = np.random.default_rng(seed)
    target_return = PAPER_BEHAVIOR_RETURN_EPS005.get(env_id)
    best, best_gap = None, np.inf
    obs, _ = env.reset(seed=seed)
    for t in range(steps):
        eps = max(0.05, 1.0 - 0.95 * t / (EXPLORATION_FRACTION.get(env_id, 0.5) * steps))
        if rng.random() < eps:
            action = int(rng.integers(n_actions))
        else:
            with torch.no_grad():
                action = int(net(torch.as_tensor(obs, dtype=torch.float32)).argmax())
        nxt, r, term, trunc, _ = env.step(action)
        i = t % size
        buf_o[i], buf_o2[i], buf_a[i], buf_r[i], buf_d[i] = obs, nxt, action, r, float(term)
        obs = nxt if not (term or trunc) else env.reset()[0]
        if t >= 1_000:
            j = torch.as_tensor(rng.integers(min(t + 1, size), size=64))
            o, o2 = torch.as_tensor(buf_o)[j], torch.as_tensor(buf_o2)[j]
            with torch.no_grad():
                y = torch.as_tensor(buf_r)[j] + 0.99 * target(o2).max(1).values * (1 - torch.as_tensor(buf_d)[j])
            q = net(o).gather(1, torch.as_tensor(buf_a)[j, None]).squeeze(1)
            loss = F.mse_loss(q, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if t % 500 == 0:
                with torch.no_grad():
                    for p, tp in zip(net.parameters(), target.parameters()):
                        tp.mul_(0.5).add_(0.5 * p)
        if (t + 1) % 2_500 == 0 and t + 1 >= steps // 4:
            layers = [m for m in net if isinstance(m, nn.Linear)]
            w = {f"{k}{i}": getattr(m, name).detach().numpy().copy()
                 for i, m in enumerate(layers) for k, name in (("w", "weight"), ("b", "bias"))}
            score = run_episodes(env_id, w, 0.05, SELECTION_EPISODES, eval_seed).mean()
            gap = abs(score - target_return) if target_return is not None else -score
            print(f"behaviour training {env_id} step {t + 1}: eps=0.05 return {score:.1f}")
            if gap < best_gap:
                best, best_gap, best_step, best_score = w, gap, t + 1, score
    meta = dict(env_id=env_id, train_steps=steps, seed=seed, selected_step=best_step,
                selected_eps005_return=float(best_score), target_return=target_return)
    atomic_savez(path, **best, meta_json=np.array(json.dumps(meta)))
    print(f"saved {path} (step {best_step}, eps=0.05 return {best_score:.1f})")


def load_behavior(path: Path, env: gym.Env) -> dict:
    if path.exists() and not path.is_file():  # a directory, pipe or device: np.load would fail or hang
        fail(f"behaviour network {path} is not a regular file; pass the .npz file of a behaviour network")
    try:
        with np.load(path, allow_pickle=False) as f:
            keys = ("w0", "b0", "w1", "b1", "w2", "b2")
            missing = [k for k in keys if k not in f.files]
            if missing:  # fail's SystemExit is not caught below
                fail(f"behaviour network {path} lacks the arrays {missing}; pass a network this script wrote "
                     "(behavior_policies/<env>.npz), or train one into a new file with --train-behavior")
            weights = {k: f[k] for k in keys}
    except FileNotFoundError:
        fail(f"behaviour network {path} not found; create it with --train-behavior")
    except Exception as e:  # not an .npz, a corrupt zip, ...
        fail(f"behaviour network {path} is unreadable ({common.npz_error(path, e)}); pass a network this script wrote "
             "(behavior_policies/<env>.npz), or train one into a new file with --train-behavior")
    obs_dim, n_actions = env.observation_space.shape[0], int(env.action_space.n)
    if weights["w0"].ndim == 2 and weights["w2"].ndim == 2 and (weights["w0"].shape[1] != obs_dim
                                                                or weights["w2"].shape[0] != n_actions):
        fail(f"behaviour network {path} is for obs dim {weights['w0'].shape[1]} / {weights['w2'].shape[0]} "
             f"actions, but the environment has {obs_dim} / {n_actions}")
    layout = {"w0": (32, obs_dim), "b0": (32,), "w1": (16, 32), "b1": (16,), "w2": (n_actions, 16), "b2": (n_actions,)}
    for k, shape in layout.items():
        w = weights[k]
        with np.errstate(over="ignore"):
            if w.dtype.kind != "f" or w.shape != shape or not np.isfinite(w.astype(np.float32)).all():
                fail(f"behaviour network {path}: {k} is not an array of shape {shape} of finite float32 numbers (obs -> "
                     f"32 -> 16 -> {n_actions}); retrain it with --train-behavior --overwrite")
    return weights


def collect(args: Args, env_id: str, epsilon: float, weights: dict, behavior_path: Path, out: Path) -> None:
    env = make_env(env_id)
    n_actions, obs_dim, N = env.action_space.n, env.observation_space.shape[0], args.num_transitions
    rng = np.random.default_rng(args.seed)
    obs_buf = np.zeros((N, obs_dim), np.float64)
    next_buf = np.zeros_like(obs_buf)
    actions, probs = np.zeros(N, np.int64), np.zeros((N, n_actions))
    rewards = np.zeros(N, np.float32)
    terminals, timeouts = np.zeros(N, bool), np.zeros(N, bool)
    episode_returns, ep_ret = [], 0.0
    obs, _ = env.reset(seed=args.seed)
    for t in range(N):
        p = behavior_probs(weights, obs[None], epsilon)[0]
        # Sample from the exact stored distribution, so the data really is drawn from beta.
        a = int(rng.choice(n_actions, p=p))
        nxt, r, term, trunc, _ = env.step(a)
        obs_buf[t], next_buf[t], actions[t], probs[t], rewards[t] = obs, nxt, a, p, r
        terminals[t], timeouts[t] = term, trunc and not term
        ep_ret += r
        if term or trunc:
            episode_returns.append(ep_ret)
            ep_ret = 0.0
            obs, _ = env.reset()
        else:
            obs = nxt
    next_probs = behavior_probs(weights, next_buf, epsilon)
    returns = behavior_returns(env_id, weights, epsilon, args.behavior_eval_episodes, args.behavior_eval_passes,
                               args.eval_seed)
    # a final score's arithmetic (common.Members.finish): the mean of the evaluations' means
    behavior_return = float(np.mean([float(r.mean()) for r in returns]))
    returns = returns.ravel()
    settings = dict(asdict(args), epsilon=epsilon, env_id=env_id, behavior_path=str(behavior_path),
                    gymnasium_version=gym.__version__, numpy_version=np.__version__, numpy_simd=numpy_simd(),
                    behavior_noise_steps=behavior_noise_steps(args.behavior_eval_passes), dataset_episodes=len(episode_returns),
                    dataset_episode_return_mean=float(np.mean(episode_returns)) if episode_returns else None)
    settings.pop("dataset_path"), settings.pop("overwrite")
    atomic_savez(
        out,
        observations=obs_buf.astype(np.float32), actions=actions, rewards=rewards,
        next_observations=next_buf.astype(np.float32), terminals=terminals, timeouts=timeouts,
        behavior_probs=probs.astype(np.float32), next_behavior_probs=next_probs.astype(np.float32),
        **{f"behavior_{k}": v.astype(np.float32) for k, v in weights.items()},
        epsilon=np.float64(epsilon), env_id=np.array(env_id),
        behavior_return=np.float64(behavior_return), behavior_return_std=np.float64(returns.std()),
        format_version=np.int64(FORMAT_VERSION), settings_json=np.array(json.dumps(settings)),
        behavior_kind=np.array("epsilon_greedy"), behavior_temperature=np.float64(1.0), behavior_floor=np.float64(0.0),
    )
    print(f"wrote {out}: {N} transitions, {len(episode_returns)} episodes, "
          f"behaviour return {behavior_return:.1f} +- {returns.std():.1f} ({len(returns)} episodes)")


CREATED: list[Path] = []  # directories this invocation made: removed again (if empty) when it fails


def writable_directory(path: Path) -> None:
    """Fail now, in one line, where the dataset could not be written later (after minutes of collection)."""
    try:
        CREATED.extend(p for p in (path.parent, *path.parent.parents) if not p.exists())
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as e:
        fail(f"cannot write {path} ({e.strerror}); pass a writable --dataset-path")


def main(args: Args) -> None:
    bad = [e for e in args.epsilon if not 0.0 <= e <= 1.0]
    if bad:
        fail(f"--epsilon must lie in [0, 1], got {bad}")
    for name in ("seed", "eval_seed", "behavior_train_seed"):
        value = getattr(args, name)
        if value is not None and not 0 <= value < 2**32:
            fail(f"--{name.replace('_', '-')} must lie in [0, 2**32), got {value}")
    if not 0 < args.num_transitions <= 10**7:  # the paper's datasets hold 10^5; the buffers live in memory
        fail(f"--num-transitions must lie in [1, 10000000], got {args.num_transitions}")
    if not 0 < args.behavior_eval_episodes <= 10_000:
        fail(f"--behavior-eval-episodes must lie in [1, 10000], got {args.behavior_eval_episodes}")
    if not 0 < args.behavior_eval_passes <= MAX_BEHAVIOR_PASSES:  # the noise of the default schedule's evaluations
        fail(f"--behavior-eval-passes must lie in [1, {MAX_BEHAVIOR_PASSES}], got {args.behavior_eval_passes}")
    if not args.epsilon:
        fail("--epsilon needs at least one value, e.g. --epsilon 0.15")
    names = [f"{e:g}" for e in args.epsilon]  # as the files name them: 0.15 and 0.150 would write one file twice
    twice = sorted({e for e in names if names.count(e) > 1})
    if twice:
        fail(f"--epsilon lists {', '.join(twice)} more than once; give each value once")
    if args.dataset_path is not None and len(args.epsilon) != 1:
        fail("--dataset-path names one file: give exactly one --epsilon with it")
    env = make_env(args.env_id)
    behavior_path = Path(args.behavior_path) if args.behavior_path else REPO / "behavior_policies" / f"{args.env_id}.npz"
    if args.train_behavior:
        steps = args.behavior_train_steps if args.behavior_train_steps is not None else PAPER_TRAIN_STEPS.get(
            args.env_id, 100_000)
        if steps < 2_500:
            fail(f"--behavior-train-steps must be at least 2500, got {steps}")
        seed = args.behavior_train_seed if args.behavior_train_seed is not None else BEHAVIOR_TRAIN_SEED.get(args.env_id, 1)
        if behavior_path.exists() and not args.overwrite:
            fail(f"--train-behavior would replace {behavior_path}; pass --overwrite to replace it, or --behavior-path "
                 "NEW.npz to train into a new file")
        writable_directory(behavior_path)
        try:
            train_behavior(args.env_id, steps, seed, behavior_path, args.eval_seed)
        except OSError as e:
            fail(f"cannot write {behavior_path} ({e.strerror or e}); nothing was written")
    weights = load_behavior(behavior_path, env)
    for eps in args.epsilon:
        out = Path(args.dataset_path) if args.dataset_path else default_dataset_path(args.env_id, eps)
        try:
            is_dir, exists = out.is_dir(), out.exists()
        except OSError as e:  # e.g. a name longer than the file system allows
            fail(f"--dataset-path {out} is invalid ({e.strerror})")
        if is_dir or exists and not out.is_file():
            fail(f"--dataset-path {out} is " + ("a directory" if is_dir else "not a regular file (a pipe or device)")
                 + "; name the .npz file to write")
        if exists and not args.overwrite:
            print(f"{out} exists; keeping it (use --overwrite to regenerate)")
            continue
        writable_directory(out)
        start = time.time()
        try:
            collect(args, args.env_id, eps, weights, behavior_path, out)
        except OSError as e:  # a full disk: atomic_savez has removed its temporary file
            fail(f"cannot write {out} ({e.strerror or e}); nothing was written")
        print(f"  ({time.time() - start:.1f}s)")


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stopped like interrupted: no partial file stays
    args = None
    try:
        args = common.parse(Args)
        main(args)
    except BaseException as e:
        for directory in CREATED:  # deepest first; a directory holding an earlier, complete dataset stays
            with contextlib.suppress(OSError):
                directory.rmdir()
        if isinstance(e, KeyboardInterrupt):
            print(f"{Path(sys.argv[0]).name}: interrupted; no partial dataset was kept", file=sys.stderr)
            raise SystemExit(130)
        if isinstance(e, BrokenPipeError):  # stdout's reader exited (`| head`): stopped like an interrupt
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not fail again
            if args is None:  # `--help | head`: the reader has what it wanted
                raise SystemExit(0)
            print(f"{Path(sys.argv[0]).name}: standard output was closed by its reader; stopped, no partial dataset "
                  "was kept", file=sys.stderr)
            raise SystemExit(141)
        if common.too_long(e):
            common.fail(common.too_long(e))
        raise
