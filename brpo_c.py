"""BRPO-C: BRPO with a constant confidence (Sohn et al., IJCAI 2020, Sec. "Experimental Results").

The residual policy pi(a|s) = (1 - lam) beta(a|s) + lam rho(a|s) with a constant lam (--lam, paper's grid
0.25 .. 0.75, final 0.5): a constant confidence always satisfies sum_a lam (rho - beta) = 0, so there is no
confidence solver, no confidence network and no projection layer. Everything else is brpo.py line for line
(`diff brpo.py brpo_c.py` shows only the confidence): rho is the relative softmax with lambda = lam
(eq. relative_soft, same temperature), the critic and W are the mu-mixed ones of Algorithm 1. One update:
  1. sample a minibatch; 2. one critic step towards r + gamma V(s'), V = (1-mu) E_beta Q' + mu max Q';
  3. soft target update. rho (and so pi) follows the critic at every state through W = Q - V.
The departures from the paper are marked "Departure N" below and explained in docs/brpo.md.

    python brpo_c.py --env-id Acrobot-v1 --epsilon 0.15 --lam 0.5
"""

from __future__ import annotations

import math
import os
import signal
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

if __name__ == "__main__":  # an interrupt while the libraries below load has nothing to clean up: one line, exit 130
    signal.signal(signal.SIGINT, lambda *_: (print(f"{Path(sys.argv[0]).name}: interrupted; nothing written",
                                                   file=sys.stderr), os._exit(130)))
    signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGINT))

import numpy as np
import torch
import torch.nn as nn

import common
from common import Evaluations, check_finite, evaluate, fail, load_checkpoint


@dataclass
class Args(common.DeployArgs):  # DeployArgs: --deploy-pessimism and the certificate's flags
    exp_name: str = Path(__file__).stem
    """name of this experiment (part of the run name)"""
    eval_greedy: bool = False
    """evaluate argmax_a pi(a|s) instead of sampling a ~ pi(.|s) (the guarantee is about the stochastic pi)"""
    mu: float = 0.9
    """critic mixing (Algorithm 1): V = (1-mu) E_beta Q + mu max Q, for the TD target and for W = Q - V"""
    lam: float = 0.5
    """constant confidence lambda in [0, 1] (departure 12; the paper's final value 0.5)"""
    kappa_max: float = 0.02
    """cap of the temperature's kappa (paper, end of Sec. 5); <= 1: a constant temperature (departure 4)"""
    kappa_decay: float = 1.0
    """temperature decay kappa <- kappa * kappa_decay**n after n updates (paper, end of Sec. 5)"""
    kappa_scale: float = 1.0
    """constant factor on kappa (ours, departure 4): with --kappa-max inf, the paper's kappa(s) at a usable scale"""
    pessimism: float = 1.0
    """lower W(s,a) by pessimism / sqrt(beta(a|s)) advantage units in rho (departure 6; 0: the paper)"""
    advantage_unit: bool = True
    """measure W in units of the critic's mean action gap in the relative softmax (departure 5; off: raw W)"""


def check_args(args: Args) -> None:
    common.check_args(args, allow_inf=("kappa_max",))  # inf: the paper's kappa(s), uncapped
    require = common.require
    require(0.0 <= args.mu <= 1.0, f"--mu must lie in [0, 1], got {args.mu}")
    require(0.0 <= args.lam <= 1.0, f"--lam must lie in [0, 1], got {args.lam}")
    require(args.kappa_max > 0, f"--kappa-max must be positive, got {args.kappa_max}")
    require(0.0 < args.kappa_scale < math.inf, f"--kappa-scale must be positive and finite, got {args.kappa_scale}")
    require(0.0 < args.kappa_decay <= 1.0, f"--kappa-decay must lie in (0, 1], got {args.kappa_decay}")
    # in advantage units: 1e3 already pins rho to beta's most frequent action
    require(0.0 <= args.pessimism <= 1e3, f"--pessimism must lie in [0, 1000], got {args.pessimism}")


# ---- Networks: FC(32)-FC(16), the architecture of every network in the paper; a constant confidence
class QNetwork(nn.Module):
    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, n_actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ConstantConfidence:
    """lambda(s, a) = lam everywhere: feasible for any rho since sum_a (rho - beta) = 0."""

    def __init__(self, lam: float, n_actions: int):
        self.lam, self.n_actions = float(lam), n_actions

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full((x.shape[0], self.n_actions), self.lam, dtype=torch.float64)


def load_confidence(ckpt: dict, args: Args, path: str = ""):
    return ConstantConfidence(args.lam, ckpt["n_actions"])


# ---- Candidate policy rho (paper Sec. 5, eq. relative_soft), float64 numpy
W_CLAMP = 1e100  # |W| cap before squaring in kappa: W^2 must stay finite in float64
TEMP_MIN = 1e-200  # smallest temperature: with |W| <= W_CLAMP, lambda W / temp stays finite
UNIT_RATE = 0.01  # running-average rate of the advantage unit (about the last 100 updates)
UNIT_MIN = 1e-8  # floor of the advantage unit: a constant critic (all gaps 0) must not divide by 0
BETA_MIN = 1e-12  # floor of beta in the pessimism term (beta = 0 actions get rho = 0 from log beta anyway)


def log_probs(p: np.ndarray) -> np.ndarray:
    """log p with log 0 = -inf: actions outside beta's support drop out of every expectation and softmax."""
    pos = p > 0
    return np.where(pos, np.log(np.where(pos, p, 1.0)), -np.inf)


def temperature(beta, lam, w, gamma, kappa_scale, kappa_max, kappa_decay, n_updates, log_beta=None):
    """tau(s) = gamma max{kappa_lambda(s), kappa_{|W| lambda}(s)} / (2 - 2 gamma) (eq. relative_soft), kappa_g(s) = 1 +
    log E_beta exp(g^2), kappa <- kappa_scale min(kappa_max, kappa) kappa_decay**n. Departure 4: kappa >= 1 keeps rho
    within ~1% of beta at gamma = 0.99; our default cap 0.02 < 1 binds everywhere, a constant temperature."""
    if kappa_max <= 1.0:  # both kappas are >= 1: the cap binds at every state
        kap = np.full(beta.shape[0], kappa_max)
    else:
        lb = log_probs(beta) if log_beta is None else log_beta
        lam2 = np.square(lam)
        x = lb + np.stack([lam2, lam2 * np.square(np.minimum(np.abs(w), W_CLAMP))])
        m = x.max(-1, keepdims=True)  # finite: beta has at least one positive entry per state
        both = 1.0 + (m[..., 0] + np.log(np.exp(x - m).sum(-1)))  # 1 + logsumexp: no overflow for large |g|
        kap = np.minimum(np.maximum(both[0], both[1]), kappa_max)
    return np.maximum(gamma * kap * (kappa_scale * kappa_decay**n_updates) / (2.0 - 2.0 * gamma), TEMP_MIN)


def candidate_policy(beta, lam, w, temp, log_beta=None):
    """rho(a|s) ∝ beta(a|s) exp(lambda W / temp) (eq. relative_soft), as a softmax of log beta + lambda W / temp:
    beta = 0 gives rho = 0 exactly, huge advantages a one-hot rho, never inf/NaN. No gradient flows through rho."""
    w = np.clip(w, -W_CLAMP, W_CLAMP)
    logits = (log_probs(beta) if log_beta is None else log_beta) + lam * w / temp[:, None]
    e = np.exp(logits - logits.max(-1)[:, None])
    return e / e.sum(-1)[:, None]


def advantage_unit(q: np.ndarray, q_max: Optional[np.ndarray] = None) -> float:
    """Departure 5: the mean action gap max_a Q - min_a Q over a batch, the unit in which the relative softmax
    measures W, so that one temperature means the same on every task (the paper's lambda W carries reward units)."""
    gap = (q.max(-1) if q_max is None else q_max) - q.min(-1)
    return float(gap.sum() / gap.shape[0])  # = gap.mean() bit for bit, with less call overhead


def sqrt_floored(beta: np.ndarray) -> np.ndarray:
    return np.sqrt(np.maximum(beta, BETA_MIN))


def candidate(beta, lam_tilde, w, args, n_updates, unit, log_beta=None, sqrt_beta=None):
    """rho and its temperature from the current raw confidence (coordinate ascent, Sec. 5), W in advantage units
    (departure 5). Departure 6: W lowered by pessimism / sqrt(beta(a|s)) units, a lower confidence bound on the
    advantage (the critic's error at (s, a) shrinks like 1 / sqrt(n(s, a)), n(s, a) proportional to beta(a|s)): rho
    follows the critic to an action only as far as the batch has seen it there."""
    log_beta = log_probs(beta) if log_beta is None else log_beta
    w = w / max(unit, UNIT_MIN) if args.advantage_unit else w
    if args.pessimism > 0:
        w = w - args.pessimism / (sqrt_floored(beta) if sqrt_beta is None else sqrt_beta)
    temp = temperature(beta, lam_tilde, w, args.gamma, args.kappa_scale, args.kappa_max, args.kappa_decay, n_updates,
                       log_beta)
    return candidate_policy(beta, lam_tilde, w, temp, log_beta), temp


def residual_policy(beta, rho, lam):
    """pi = (1 - lambda) beta + lambda rho (Sec. 2); the clamp and renormalisation only remove rounding."""
    pi = (beta + lam * (rho - beta)).clamp_min(0.0)
    return pi / pi.sum(-1, keepdim=True)


# ---- Critic (Algorithm 1, line 6)
def mixed_value(q: np.ndarray, beta: np.ndarray, mu: float, q_max: Optional[np.ndarray] = None) -> np.ndarray:
    """V(s) = (1-mu) E_beta Q(s, .) + mu max_a Q(s, a), for the TD target and for W = Q - V."""
    return (1.0 - mu) * (beta * q).sum(-1) + mu * (q.max(-1) if q_max is None else q_max)


def critic_output_grad(q_all: np.ndarray, a: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """d/dQ(s, .) of the TD loss mean_s (Q(s, a_s) - y_s)^2 (float32, bit for bit autograd's through gather +
    mse_loss; tested) and the TD errors: backward() from it keeps those small graph nodes out of every update."""
    rows = np.arange(a.shape[0])
    td_error = q_all[rows, a] - y
    g = np.zeros_like(q_all)
    g[rows, a] = np.float32(2.0 / a.shape[0]) * td_error
    return g, td_error


# ---- The deployed policy and its evaluation
def policy_probs(obs, beta, q_network, confidence, args, n_updates, unit):
    """pi(.|s) at arbitrary states (no gradient): the deployed residual policy."""
    with torch.no_grad():
        q = q_network(obs).double()
        w = q - torch.from_numpy(mixed_value(q.numpy(), beta.numpy(), args.mu))[:, None]
        lam = confidence(obs)  # constant: already feasible
        rho, _ = candidate(beta.numpy(), lam.numpy(), w.numpy(), args, n_updates, unit)
        return residual_policy(beta, torch.from_numpy(rho), lam)


def make_actor(behavior, q_network, confidence, args, greedy: bool):
    """act(obs) for evaluate(); state: n_updates, unit, args (the deployed level), deploy_pi (False: beta), generator
    (re-seeded with eval_seed + n_updates: each evaluation is reproducible on its own)."""
    state = {"n_updates": 0, "unit": 1.0, "generator": torch.Generator(), "deploy_pi": True, "args": args}

    def act(obs: np.ndarray) -> np.ndarray:
        o = torch.from_numpy(obs)
        beta = behavior(o)
        pi = policy_probs(o, beta, q_network, confidence, state["args"], state["n_updates"],
                          state["unit"]) if state["deploy_pi"] else beta
        return pi.argmax(1).numpy() if greedy else torch.multinomial(pi, 1, generator=state["generator"]).squeeze(1).numpy()

    return act, state


def load_policy(path: str, greedy: bool = False, eval_seed: int = 10_000):
    """A saved policy (--eval-checkpoint, certify.py): checkpoint, act(obs), probs(obs, beta) -> pi(.|s), critic Q(s, .)."""
    ckpt = load_checkpoint(path, Path(__file__).stem, dict(q_network=dict, behavior=dict, args=dict, n_updates=int,
                                                           advantage_unit=float, deploy_pi=bool, deploy_pessimism=float))
    saved = common.saved_args(ckpt, Args, check_args, path)  # the policy's own settings; evaluation's from the flags
    common.require(ckpt["advantage_unit"] > 0 and 0.0 <= ckpt["deploy_pessimism"] <= 1e3,
                   f"checkpoint {path}: its advantage unit or deployed pessimism is invalid")
    behavior = common.behavior_from_checkpoint(ckpt, path)
    q_network = QNetwork(ckpt["obs_dim"], ckpt["n_actions"])
    common.load_weights(path, q_network, ckpt["q_network"])
    confidence = load_confidence(ckpt, saved, path)
    act, state = make_actor(behavior, q_network, confidence, saved, greedy)
    state.update(n_updates=ckpt["n_updates"], unit=ckpt["advantage_unit"], deploy_pi=ckpt["deploy_pi"],
                 args=replace(saved, pessimism=ckpt["deploy_pessimism"]))  # the level deployed when saved
    state["generator"].manual_seed(eval_seed + ckpt["n_updates"])  # the run's own evaluation at that point

    def probs(obs: np.ndarray, beta: np.ndarray) -> np.ndarray:
        pi = policy_probs(torch.from_numpy(obs), torch.from_numpy(beta), q_network, confidence, state["args"],
                          state["n_updates"], state["unit"]).numpy() if state["deploy_pi"] else beta
        return common.one_hot(pi.argmax(1), ckpt["n_actions"]) if greedy else pi

    return ckpt, act, probs, common.q_function(q_network)


def run_checkpoint(args: Args) -> None:
    ckpt, act, _, _ = load_policy(args.eval_checkpoint, args.eval_greedy, args.eval_seed)
    common.evaluate_checkpoint(args.eval_checkpoint, act, ckpt["env_id"], args.eval_episodes, args.eval_seed,
                               "" if ckpt["deploy_pi"] else " (beta: pi was not certified when saved)")


def main(args: Args) -> None:
    common.main(args, check_args, train, run_checkpoint, behavior_network=True)


# ---- Training
def train(args: Args, data: dict, dataset_path: Path, run_dir: Path, writer, obs_dim: int, n_actions: int) -> None:
    # --- setup ---
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    obs = torch.as_tensor(data["observations"])
    actions_np = data["actions"]
    bootstrap = args.gamma * (1.0 - data["terminals"].astype(np.float32))  # timeouts are not terminal: bootstrapped
    # beta in float64, renormalised: sum_a (rho - beta) must be 0 to ~1e-16 for the equality constraint
    behavior_probs = torch.as_tensor(data["behavior_probs"], dtype=torch.float64)
    behavior_probs /= behavior_probs.sum(1, keepdim=True)
    beta_all = behavior_probs.numpy()
    next_obs, next_beta = torch.as_tensor(data["next_observations"]), data["next_behavior_probs"]
    rewards, bootstrap = torch.as_tensor(data["rewards"]), torch.as_tensor(bootstrap)
    behavior = common.behavior_policy(data)
    (cert, z), levels = common.deployment_certificate(args, data, beta_all, behavior), common.deploy_levels(args)
    cert_obs, cert_beta = (obs[cert["rows"]], behavior_probs[cert["rows"]]) if cert else (None, None)
    certificate = {}

    q_network = QNetwork(obs_dim, n_actions)
    target_network = QNetwork(obs_dim, n_actions)
    target_network.load_state_dict(q_network.state_dict())
    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate, fused=True)
    confidence = load_confidence({"n_actions": n_actions}, args)
    eval_envs = common.make_eval_envs(args)
    act, actor_state = make_actor(behavior, q_network, confidence, args, args.eval_greedy)
    log = Evaluations(args, writer, data)

    for step in range(1, args.total_steps + 1):
        # --- update: critic (Algorithm 1, line 6) ---
        idx = torch.randint(len(actions_np), (args.batch_size,), generator=generator).numpy()
        ti = torch.from_numpy(idx)
        s, next_s, r, boot = obs[ti], next_obs[ti], rewards[ti], bootstrap[ti]
        with torch.no_grad():
            next_q = target_network(next_s).numpy()
        next_v = mixed_value(next_q, next_beta[idx], args.mu)
        td_target = torch.addcmul(r, torch.from_numpy(next_v), boot)  # r + gamma (1 - terminal) V(s')
        q_all = q_network(s)
        q32 = q_all.detach().numpy()
        if not np.isfinite(q32).all():  # stop at once: a diverged critic's values would poison every later step
            fail(f"training diverged: the critic's values are NaN or inf after {step - 1} updates; try a lower --learning-rate")
        q_grad, td_error = critic_output_grad(q32, actions_np[idx], td_target.numpy())
        q_np = q32.astype(np.float64)
        q_max = q_np.max(-1)
        unit = advantage_unit(q_np, q_max) if step == 1 else (1.0 - UNIT_RATE) * unit + UNIT_RATE * advantage_unit(q_np, q_max)  # dep. 5

        optimizer.zero_grad()
        q_all.backward(torch.from_numpy(q_grad))
        optimizer.step()
        if step % args.target_update_frequency == 0:
            with torch.no_grad():
                for p, tp in zip(q_network.parameters(), target_network.parameters()):
                    tp.lerp_(p, args.tau)

        # --- log ---
        if writer and step % 100 == 0:
            writer.add_scalar("losses/td_loss", float(np.square(td_error, dtype=np.float64).mean()), step)
            writer.add_scalar("losses/q_values", float(q32[np.arange(len(idx)), actions_np[idx]].mean()), step)
            writer.add_scalar("confidence/advantage_unit", unit, step)

        # --- evaluate ---
        if log.due(step):
            log.pause()
            check_finite(step, q_network)
            actor_state["n_updates"], actor_state["unit"] = step, unit
            level = 0
            if cert:  # departure 11: the batch's improvement certificate picks the deployed pessimism level
                with torch.no_grad():
                    q_batch = q_network(cert_obs).double().numpy()
                pis = [policy_probs(cert_obs, cert_beta, q_network, confidence, replace(args, pessimism=p), step,
                                    unit).numpy() for p in levels]
                level, certificate = common.choose_level(pis, q_batch, cert, z)
            actor_state["args"] = replace(args, pessimism=levels[level])
            actor_state["deploy_pi"] = not args.safety_test or certificate.get("certified", 0.0) == 1.0
            actor_state["generator"].manual_seed(args.eval_seed + step)
            returns = evaluate(act, eval_envs, args.eval_seed) if eval_envs else None  # None: the certificate scores
            log.record(step, returns, deployed="pi" if actor_state["deploy_pi"] else "beta",
                       pessimism=levels[level], **certificate)
            if writer:
                writer.add_scalar("charts/deployed_pi", float(actor_state["deploy_pi"]), step)
                writer.add_scalar("charts/deployed_pessimism", levels[level], step)
                for key in ("certificate", "certificate_lcb"):
                    if key in certificate:
                        writer.add_scalar(f"losses/{key}", certificate[key], step)

    # --- finish ---
    extra = {**certificate, "deployed_pi": float(actor_state["deploy_pi"]),  # the last evaluation's
             "deployed_pessimism": actor_state["args"].pessimism}
    log.finish("brpo_c", data, dataset_path, run_dir, extra, {
        "obs_dim": obs_dim, "n_actions": n_actions, "q_network": q_network.state_dict(),
        "n_updates": args.total_steps, **common.behavior_spec(data),
        "deploy_pi": actor_state["deploy_pi"], "deploy_pessimism": actor_state["args"].pessimism,
        "advantage_unit": unit})
    common.report_certificate(certificate, cert and cert["n_episodes"], args, actor_state["deploy_pi"],
                              actor_state["args"].pessimism)


if __name__ == "__main__":
    common.cli(Args, main)
