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
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # an interrupt while the libraries below load has nothing to clean up: one line, exit 130
    signal.signal(signal.SIGINT, lambda *_: (print(f"{Path(sys.argv[0]).name}: interrupted; nothing written",
                                                   file=sys.stderr), os._exit(130)))
    signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGINT))

import numpy as np
import torch
import torch.nn as nn

import common
from common import load_checkpoint


# --sweep may vary these (and --learning-rate, --gamma, --tau, --target-update-frequency) between members
MEMBER_FLAGS = ("lam", "mu", "kappa_max", "kappa_decay", "kappa_scale", "pessimism", "cql_alpha")


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
    cql_alpha: float = 0.0
    """weight of CQL(H)'s term logsumexp_a Q(s, a) - Q(s, a_data) in the critic's loss (departure 13; 0: the paper)"""
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
    require(0.0 <= args.cql_alpha < math.inf, f"--cql-alpha must be a finite number >= 0, got {args.cql_alpha}")


# ---- Networks: FC(32)-FC(16), the architecture of every network in the paper; a constant confidence
class QNetwork(nn.Module):
    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, n_actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ConstantConfidence:
    """lambda(s, a) = lam everywhere, each member its own --lam ([M, 1]): feasible for any rho since sum_a (rho - beta)
    = 0. __call__(obs [M, N, dim]) -> [M, N, |A|] float64."""

    def __init__(self, lam: np.ndarray, n_actions: int):
        self.lam, self.n_actions = lam, n_actions

    def __call__(self, obs: torch.Tensor) -> np.ndarray:
        return np.broadcast_to(self.lam[..., None], (*obs.shape[:-1], self.n_actions))

    def select(self, members: list) -> "ConstantConfidence":
        return ConstantConfidence(self.lam[members], self.n_actions)


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
    within ~1% of beta at gamma = 0.99; our default cap 0.02 < 1 binds everywhere, a constant temperature.
    beta, lam, w: [M, B, |A|]; the flags: [M, 1] (one row per member); returns [M, B]."""
    capped = np.asarray(kappa_max) <= 1.0  # both kappas are >= 1: the cap binds at every state
    if capped.all():
        kap = np.broadcast_to(kappa_max, beta.shape[:-1])
    else:
        lb = log_probs(beta) if log_beta is None else log_beta
        lam2 = np.square(lam)
        x = lb + np.stack([lam2, lam2 * np.square(np.minimum(np.abs(w), W_CLAMP))])
        m = x.max(-1, keepdims=True)  # finite: beta has at least one positive entry per state
        both = 1.0 + (m[..., 0] + np.log(np.exp(x - m).sum(-1)))  # 1 + logsumexp: no overflow for large |g|
        kap = np.where(capped, kappa_max, np.minimum(np.maximum(both[0], both[1]), kappa_max))
    return np.maximum(gamma * kap * (kappa_scale * kappa_decay**n_updates) / (2.0 - 2.0 * gamma), TEMP_MIN)


def candidate_policy(beta, lam, w, temp, log_beta=None):
    """rho(a|s) ∝ beta(a|s) exp(lambda W / temp) (eq. relative_soft), as a softmax of log beta + lambda W / temp:
    beta = 0 gives rho = 0 exactly, huge advantages a one-hot rho, never inf/NaN. No gradient flows through rho."""
    w = np.clip(w, -W_CLAMP, W_CLAMP)
    logits = (log_probs(beta) if log_beta is None else log_beta) + lam * w / temp[..., None]
    e = np.exp(logits - common.row_max(logits, True))
    return e / common.row_sum(e, True)


def advantage_unit(q: torch.Tensor, q_max: torch.Tensor | None = None) -> torch.Tensor:
    """Departure 5: the mean action gap max_a Q - min_a Q over a batch [M, B, |A|], per member: the relative softmax's
    unit of W, so that one temperature means the same on every task (the paper's lambda W carries reward units)."""
    return ((q.amax(-1) if q_max is None else q_max) - q.amin(-1)).mean(-1)


def sqrt_floored(beta: np.ndarray) -> np.ndarray:
    return np.sqrt(np.maximum(beta, BETA_MIN))


def candidate(beta, lam_tilde, w, p, pessimism, n_updates, unit, log_beta=None, sqrt_beta=None):
    """rho and its temperature from the current raw confidence (coordinate ascent, Sec. 5), W in advantage units
    (departure 5). Departure 6: W lowered by pessimism / sqrt(beta(a|s)) units, a lower confidence bound on the
    advantage (the critic's error at (s, a) shrinks like 1 / sqrt(n(s, a)), n(s, a) proportional to beta(a|s)): rho
    follows the critic to an action only as far as the batch has seen it there. p: the members' flags
    (common.columns), pessimism [M, 1], unit [M]."""
    log_beta = log_probs(beta) if log_beta is None else log_beta
    w = np.where(p.advantage_unit[..., None], w / np.maximum(unit, UNIT_MIN)[:, None, None], w)
    w = w - pessimism[..., None] / (sqrt_floored(beta) if sqrt_beta is None else sqrt_beta)
    temp = temperature(beta, lam_tilde, w, p.gamma, p.kappa_scale, p.kappa_max, p.kappa_decay, n_updates, log_beta)
    return candidate_policy(beta, lam_tilde, w, temp, log_beta), temp


def residual_policy(beta, rho, lam):
    """pi = (1 - lambda) beta + lambda rho (Sec. 2); the clamp and renormalisation only remove rounding."""
    pi = np.maximum(beta + lam * (rho - beta), 0.0)
    return pi / common.row_sum(pi, True)


# ---- Critic (Algorithm 1, line 6)
def mixed_value(q, beta, mu, q_max=None):
    """V(s) = (1-mu) E_beta Q(s, .) + mu max_a Q(s, a), for the TD target and for W = Q - V (mu: [M, 1])."""
    return (1.0 - mu) * common.row_sum(beta * q) + mu * (common.row_max(q) if q_max is None else q_max)


# ---- The deployed policy and its evaluation
FLAGS = ("mu", "gamma", "kappa_scale", "kappa_max", "kappa_decay", "pessimism", "advantage_unit", "lam")  # the flags the method's functions read, one row per member (common.columns)


def policy_probs(obs, beta, q_network, confidence, p, pessimism, n_updates, unit, q=None, log_beta=None,
                 sqrt_beta=None, lam_tilde=None):
    """pi(.|s) [M, N, |A|] at arbitrary states obs [M, N, dim] (no gradient): the deployed residual policy. q (the
    critic's values), log_beta, sqrt_beta, lam_tilde (the raw confidence): computed here unless given."""
    with torch.no_grad():
        q = q_network(obs).double().numpy() if q is None else q
        w = q - mixed_value(q, beta, p.mu)[..., None]
        lam = confidence(obs) if lam_tilde is None else lam_tilde  # constant: already feasible
        rho, _ = candidate(beta, lam, w, p, pessimism, n_updates, unit, log_beta, sqrt_beta)
        return residual_policy(beta, rho, lam)


def make_actor(behavior, q_network, confidence, p, greedy: bool):
    """act(obs [M, E, dim], u) -> actions [M, E] for evaluation: pi's argmax, or a draw of pi with the uniforms u;
    state: n_updates, unit [M], pessimism [M, 1] (the deployed levels), deploy_pi [M] (False: beta)."""
    state = {"n_updates": 0, "unit": np.ones(len(p.mu)), "pessimism": p.pessimism, "deploy_pi": np.ones(len(p.mu), bool)}

    def act(obs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        beta = behavior(obs).numpy()
        pi = policy_probs(obs, beta, q_network, confidence, p, state["pessimism"], state["n_updates"], state["unit"])
        # beta where pi is not deployed, and for a diverged member (NaN; its run is dropped)
        pi = torch.from_numpy(np.where(state["deploy_pi"][:, None, None] & np.isfinite(pi), pi, beta))
        return pi.argmax(-1) if greedy else common.sample(pi, u.double())

    return act, state


def load_policy(path: str, greedy: bool = False, eval_seed: int = 10_000):
    """A saved policy (--eval-checkpoint, certify.py): checkpoint, act(obs, u), probs(obs, beta) -> pi(.|s), critic
    Q(s, .), on observations [1, N, dim]."""
    ckpt = load_checkpoint(path, Path(__file__).stem, dict(q_network=dict, behavior=dict, args=dict, n_updates=int,
                                                           advantage_unit=float, deploy_pi=bool, deploy_pessimism=float))
    saved = common.saved_args(ckpt, Args, check_args, path)  # the policy's own settings; evaluation's from the flags
    common.require(ckpt["advantage_unit"] > 0 and 0.0 <= ckpt["deploy_pessimism"] <= 1e3,
                   f"checkpoint {path}: its advantage unit or deployed pessimism is invalid")
    behavior = common.behavior_from_checkpoint(ckpt, path)
    q_network = QNetwork(ckpt["obs_dim"], ckpt["n_actions"])
    common.load_weights(path, q_network, ckpt["q_network"])
    q, p = common.Stack([q_network.net]), common.columns([saved], *FLAGS)
    confidence = ConstantConfidence(p.lam, ckpt["n_actions"])
    act, state = make_actor(lambda obs: behavior(obs[0])[None], q, confidence, p, greedy)
    state.update(n_updates=ckpt["n_updates"], unit=np.array([ckpt["advantage_unit"]]), deploy_pi=np.array([ckpt[
        "deploy_pi"]]), pessimism=np.array([[ckpt["deploy_pessimism"]]]))  # the level deployed when saved

    def probs(obs, beta: np.ndarray) -> np.ndarray:
        pi = policy_probs(torch.as_tensor(obs), beta, q, confidence, p, state["pessimism"], state["n_updates"],
                          state["unit"]) if state["deploy_pi"][0] else beta
        return common.one_hot(pi.argmax(-1), ckpt["n_actions"]) if greedy else pi

    return ckpt, act, probs, common.q_function(q)


def run_checkpoint(args: Args) -> None:
    ckpt, act, _, _ = load_policy(args.eval_checkpoint, args.eval_greedy, args.eval_seed)
    common.evaluate_checkpoint(args.eval_checkpoint, act, ckpt["env_id"], args.eval_episodes, args.eval_seed,
                               "" if ckpt["deploy_pi"] else " (beta: pi was not certified when saved)", ckpt["n_updates"])


def main(args: Args) -> None:
    common.main(args, check_args, train, run_checkpoint, behavior_network=True, member_flags=MEMBER_FLAGS)


# ---- Training
def train(runs: common.Members) -> None:
    # --- setup ---
    first, M = runs.first, runs.M
    p = common.columns(runs.args, *FLAGS)
    obs, next_obs, rewards = runs.tensor("observations"), runs.tensor("next_observations"), runs.tensor("rewards")
    actions, not_done = runs.tensor("actions"), 1.0 - runs.tensor("terminals").float()  # timeouts: bootstrapped
    gamma32 = torch.from_numpy(p.gamma.astype(np.float32))
    # beta in float64, renormalised: sum_a (rho - beta) must be 0 to ~1e-16 for the equality constraint
    beta_all = runs.tensor("behavior_probs").double().numpy()
    beta_all /= beta_all.sum(1, keepdims=True)
    next_beta = runs.tensor("next_behavior_probs")
    mu32 = torch.from_numpy(p.mu.astype(np.float32))
    groups = common.deployment_groups(runs, beta_all, log_probs, sqrt_floored)  # departure 11

    q_network = common.Stack(*runs.build(lambda: [QNetwork(runs.obs_dim, runs.n_actions).net]))
    confidence = ConstantConfidence(p.lam, runs.n_actions)
    target_network = q_network.copy()
    critic_optimizer = common.Adam(q_network, runs.column("learning_rate"))
    tau, period = runs.column("tau"), runs.column("target_update_frequency", torch.long)
    td_loss_of = common.td_loss(runs.column("huber_delta"))  # squared error (the paper) or Huber's (departure 14)
    cql_alpha = runs.column("cql_alpha")  # [M, 1]
    cql_on = bool(cql_alpha.any())  # once: the paper's critic (every alpha 0) skips the term
    evaluation = common.PolicyEvaluation(runs, lambda: QNetwork(runs.obs_dim, runs.n_actions).net,
                                         first.evaluation_critic)  # departure 15
    act, actor_state = make_actor(runs.behavior(), q_network, confidence, p, first.eval_greedy)
    certificates, unit = [{} for _ in range(M)], None

    for step in range(1, first.total_steps + 1):
        # --- update: critic target and W (Algorithm 1, line 6) ---
        batch = runs.minibatch(step)  # batch(t): t's rows [M, batch, ...]
        s = batch(obs)
        with torch.no_grad():
            next_q = target_network(batch(next_obs))
            next_v = mixed_value(next_q, batch(next_beta), mu32, next_q.max(-1).values)
        discount = gamma32 * batch(not_done)
        td_target = torch.addcmul(batch(rewards), next_v, discount)  # r + gamma (1 - terminal) V(s')
        q_all = q_network(s)
        q64 = q_all.detach().double()
        for m in np.flatnonzero(~q64.isfinite().all(-1).all(-1).numpy()):  # a diverged critic would poison the rest
            if runs.alive[m]:
                runs.drop(m, f"training diverged: the critic's values are NaN or inf after {step - 1} updates; try a "
                             "lower --learning-rate")
            q64[m] = 0.0  # a dropped member's numbers are discarded: zeros, not NaN in every array below
        q_taken = q_all.gather(-1, batch(actions).unsqueeze(-1)).squeeze(-1)
        td_loss = td_loss_of(q_taken, td_target)  # [M]: each member's mean TD loss
        # departure 13: a conservative critic, CQL(H)'s alpha E_s[logsumexp_a Q(s, a) - Q(s, a_data)] (Kumar et al. eq. 4)
        critic_loss = td_loss + (cql_alpha * (torch.logsumexp(q_all, -1) - q_taken)).mean(1) if cql_on else td_loss
        q_max = q64.amax(-1)
        batch_unit = advantage_unit(q64, q_max)  # departure 5
        unit = batch_unit if step == 1 else (1.0 - UNIT_RATE) * unit + UNIT_RATE * batch_unit
        critic_loss.sum().backward()
        critic_optimizer.step()
        common.soft_update(step, target_network, q_network, period, tau)
        evaluation.update(step, batch, s, next_obs, actions, rewards, discount)

        # --- log ---
        runs.log(step, lambda: {"losses/td_loss": td_loss, "losses/q_values": q_taken.mean(1),
                        "confidence/advantage_unit": unit})

        # --- evaluate ---
        if runs.due(step):
            runs.pause()
            # departures 11 and 15: the certificate picks the pessimism level, the evaluation critic (opt-in) pi or beta
            pessimism, deploy_pi, certificates = common.deploy(runs, step, obs, next_obs, q_network, confidence, p,
                                                               unit.numpy(), groups, evaluation, policy_probs, FLAGS)
            actor_state.update(n_updates=step, unit=unit.numpy(), pessimism=pessimism, deploy_pi=deploy_pi)
            runs.evaluate(step, [q_network] + evaluation.nets, act, extra=[
                {"deployed": "pi" if deploy_pi[m] else "beta", "pessimism": float(pessimism[m, 0]), **certificates[m]}
                for m in range(M)])
            runs.log(step, {"charts/deployed_pi": deploy_pi, "charts/deployed_pessimism": pessimism[:, 0],
                            **{f"losses/{k}": [c.get(k, np.nan) for c in certificates] for k in ("certificate",
                               "certificate_lcb", "fqe_gain") if all(k in c for c in certificates)}}, every=1)

    # --- finish ---
    runs.finish("brpo_c", lambda m: {**certificates[m], "deployed_pi": float(actor_state["deploy_pi"][m]),  # the last
                                   "deployed_pessimism": float(actor_state["pessimism"][m, 0])}, lambda m: {
        "obs_dim": runs.obs_dim, "n_actions": runs.n_actions, "q_network": q_network.state_dict(m, "net."),
        "n_updates": first.total_steps,
        **common.behavior_spec(runs.data[m]), "deploy_pi": bool(actor_state["deploy_pi"][m]),
        "deploy_pessimism": float(actor_state["pessimism"][m, 0]), "advantage_unit": float(unit[m])})
    n_episodes = {m: cert and cert["n_episodes"] for cert, _, members in groups.values() for m in members}
    for m in range(M):
        if runs.alive[m]:
            common.report_certificate(certificates[m], n_episodes[m], runs.args[m], actor_state["deploy_pi"][m],
                                      float(actor_state["pessimism"][m, 0]))


if __name__ == "__main__":
    common.cli(Args, main)
