"""Where does a trained BRPO policy gain or lose against beta? Evaluate a saved brpo.py model (--save-model)
next to variants that keep some of its parts and replace others, all on the same start states.

    python benchmark/brpo_variants.py runs/<run>/model.pt --episodes 400

Variants (each a distribution over actions at every visited state, sampled; same start states for all):
  pi          the deployed residual policy pi = beta + lambda (rho - beta)          (brpo.py --eval-checkpoint)
  beta        the behaviour policy
  greedy      beta's greedy action (epsilon = 0)
  q-greedy    the critic's greedy action (argmax Q: the candidate at temperature 0, taken everywhere)
  lam-const   pi with the confidence network's output replaced by a constant (--lam, default 0.7)
  w-zero      pi with W = 0 in the candidate: rho moves only by the trained level's pessimism term
  no-pess     pi with the pessimism term removed from the candidate (level 0 at deployment)
  pess=X      pi with the pessimism term scaled to X at deployment only (pess=0 is no-pess)
(pi is the deployed level; w-zero uses the trained one: --pessimism, 0 by default, where w-zero is beta)
  uniform     beta moved towards its greedy action by the same average amount as pi, at every state alike
For diagnosis only: the variants are not methods (lam-const is BRPO-C's confidence on BRPO's networks).
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import brpo  # noqa: E402
import common  # noqa: E402

VARIANTS = ("pi", "beta", "greedy", "q-greedy", "lam-const", "w-zero", "no-pess", "uniform")


@dataclass
class Args:
    checkpoint: tyro.conf.Positional[str]
    """model.pt saved by brpo.py --save-model"""
    episodes: int = 400
    """evaluation episodes per variant; episode i starts from reset(seed=eval_seed + i)"""
    eval_seed: int = 10_000
    """first start-state seed (brpo.py's default)"""
    variants: tuple[str, ...] = VARIANTS
    """which variants to evaluate"""
    lam: float = 0.7
    """the constant confidence of lam-const"""
    certificate: bool = False
    """also print each variant's improvement certificate on the model's own dataset (common.improvement_certificate)"""


def main(args: Args) -> None:
    torch.set_num_threads(1)
    bad = {v for v in args.variants if v not in VARIANTS and not v.startswith("pess=")}
    if bad:
        raise SystemExit(f"error: unknown variant(s) {sorted(bad)}; choose from {', '.join(VARIANTS)}")
    try:
        ckpt = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
    except Exception as e:
        raise SystemExit(f"error: cannot read {args.checkpoint} ({type(e).__name__}: {e}); pass a brpo.py model.pt")
    if ckpt.get("algorithm") != "brpo":
        raise SystemExit(f"error: {args.checkpoint} was saved by {ckpt.get('algorithm')}.py; this needs a brpo.py model")
    saved = brpo.Args(**{k: v for k, v in ckpt["args"].items() if k in brpo.Args.__dataclass_fields__})
    q_net = brpo.QNetwork(ckpt["obs_dim"], ckpt["n_actions"])
    q_net.load_state_dict(ckpt["q_network"])
    q_network, confidence = common.Stack([q_net.net]), brpo.load_confidence(ckpt, saved)  # one member: [1, N, ...]
    behavior = common.behavior_from_checkpoint(ckpt, args.checkpoint)
    n_updates, unit = ckpt["n_updates"], np.array([ckpt["advantage_unit"]])
    p = common.columns([saved], *brpo.FLAGS)
    deployed = np.array([[ckpt.get("deploy_pessimism", saved.pessimism)]])  # the level brpo.py deployed

    def residual(obs, beta, lam_tilde=None, w_zero=False, pessimism=saved.pessimism):
        with torch.no_grad():
            q = q_network(obs[None]).double().numpy()
            w = q - brpo.mixed_value(q, beta.numpy()[None], p.mu)[..., None]
            lt = confidence(obs[None]).double().numpy() if lam_tilde is None else np.full_like(w, lam_tilde)
        w = np.zeros_like(w) if w_zero else w
        rho, _ = brpo.candidate(beta.numpy()[None], lt, w, p, np.array([[pessimism]]), n_updates, unit)
        lam = brpo.project_confidence(lt[0], rho[0] - beta.numpy())
        return torch.from_numpy(brpo.residual_policy(beta.numpy(), rho[0], lam))

    def probs(variant, obs):
        beta = behavior(obs)
        one_hot = torch.nn.functional.one_hot(beta.argmax(1), beta.shape[1]).double()
        if variant == "pi":  # exactly what brpo.py deploys
            return torch.from_numpy(brpo.policy_probs(obs[None], beta.numpy()[None], q_network, confidence, p, deployed,
                                                      n_updates, unit)[0])
        if variant == "beta":
            return beta
        if variant == "greedy":
            return one_hot
        if variant == "q-greedy":
            with torch.no_grad():
                return torch.nn.functional.one_hot(q_network(obs[None])[0].argmax(1), beta.shape[1]).double()
        if variant == "lam-const":
            return residual(obs, beta, lam_tilde=args.lam)
        if variant == "w-zero":
            return residual(obs, beta, w_zero=True)
        if variant.startswith("pess="):
            return residual(obs, beta, pessimism=float(variant[5:]))
        if variant == "no-pess":
            return residual(obs, beta, pessimism=0.0)
        # uniform: pi's average gain of probability on beta's greedy action, as one fraction of the way to it
        gain = (probs("pi", obs) - beta).mul(one_hot).sum(1).mean() / (1.0 - beta.mul(one_hot).sum(1)).mean()
        return beta + gain.clamp(0.0, 1.0) * (one_hot - beta)

    if args.certificate:
        data = np.load(saved.dataset_path or common.REPO / "datasets" / f"{ckpt['env_id']}_eps{ckpt['epsilon']:g}.npz")
        data = {k: data[k] for k in ("observations", "next_observations", "actions", "rewards", "terminals",
                                     "timeouts", "behavior_probs")}
        beta_batch = data["behavior_probs"].astype(np.float64)
        beta_batch /= beta_batch.sum(1, keepdims=True)  # as brpo.py does
        cert, reason = common.certificate_data(data, beta_batch, saved.certificate_gamma, behavior)
        if reason:
            raise SystemExit(f"error: no certificate: {reason}")
        z = statistics.NormalDist().inv_cdf(saved.certificate_confidence)
        cert_obs = torch.from_numpy(data["observations"][cert["rows"]])
        with torch.no_grad():
            q = q_network(cert_obs[None])[0].double().numpy()
        print(f"certificates on {cert['n_episodes']} logged episodes (first order, {saved.certificate_confidence:.0%} "
              "lower bound of each variant on its own; tv: total-variation distance to beta on the same states, the one "
              "brpo.py's deployed-level rule compares):")
        for variant in args.variants:
            with torch.no_grad():
                pi = probs(variant, cert_obs).double().numpy()
            c = common.improvement_certificate(pi, q, cert, z)
            tv = common.tv_to_beta(pi, cert["beta"])
            print(f"  {variant:10s} {c['certificate']:8.2f} +- {c['certificate_se']:.2f}  lcb {c['certificate_lcb']:8.2f}"
                  f"  tv {tv:.4f}" + ("  certified" if c["certified"] else ""), flush=True)

    print(f"{args.checkpoint}: {ckpt['env_id']} eps {ckpt['epsilon']:g}, {args.episodes} episodes from "
          f"reset(seed={args.eval_seed} + i), sampled with seed {args.eval_seed}")
    simulators = common.Simulators(ckpt["env_id"], 1, args.episodes, args.eval_seed)
    for variant in args.variants:
        def act(obs: torch.Tensor, u: torch.Tensor, variant=variant) -> torch.Tensor:
            return common.sample(probs(variant, obs[0])[None], u.double())

        returns = simulators.run(act, args.eval_seed)[0]
        print(f"{variant:10s} {returns.mean():8.1f}  (s.e. {returns.std() / np.sqrt(len(returns)):.1f})", flush=True)


if __name__ == "__main__":
    try:
        main(common.parse(Args))
    except BrokenPipeError:  # `| head`: stop quietly, as run_grid.py does
        common.quiet_stdout()
        sys.exit(0)
