"""Does a saved policy improve on the behaviour policy of its batch? The improvement certificate, for any script's
model.pt (--save-model), from the logged returns of the batch alone.

    python certify.py runs/<run-name>/model.pt
    python certify.py runs/<run-name>/model.pt --dataset-path my_batch.npz --certificate-confidence 0.99

It estimates the first-order improvement g of pi over beta along beta + c (pi - beta) (the policy-gradient identity,
doubly robust, cross-fitted over episodes), its standard error over the logged episodes, and the one-sided lower
bound g - z se: "certified" when that bound is above 0 (above rounding: 1e-9 times the largest |return|). What
this does and does not guarantee: docs/brpo.md, "The improvement certificate". The control variate uses the
policy's own critic where it has one (the behaviour network's otherwise). For a brpo.py or brpo_c.py model this is the g and standard error of its last evaluation
(the deployed policy, with its certificate discount); their lower bound there is simultaneous over the
--deploy-pessimism levels (Bonferroni), here it is for this one policy.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import tyro

import common
from common import fail, require

SCRIPTS = ("bc", "dqn_offline", "klq", "bcq_discrete", "spibb", "brpo", "brpo_c", "cql_discrete")


@dataclass
class Args:
    checkpoint: tyro.conf.Positional[str]
    """model.pt written by any algorithm script's --save-model"""
    dataset_path: Optional[str] = None
    """the batch to certify on; default: the one the model was trained on"""
    certificate_confidence: float = 0.95
    """one-sided confidence level of the lower bound (the same flag name as brpo.py's)"""
    certificate_gamma: Optional[float] = None
    """discount of the logged returns-to-go (default: the model's own --certificate-gamma, else 0.99)"""
    eval_greedy: bool = False
    """certify the argmax policy that --eval-greedy evaluates, not the stochastic one (greedy scripts are anyway)"""
    json: bool = False
    """print the result as one JSON object"""


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"_certify_{name}", common.REPO / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def main(args: Args) -> None:
    if not 0.5 <= args.certificate_confidence <= 1.0 - 1e-9:
        fail(f"--certificate-confidence must lie in [0.5, 1), got {args.certificate_confidence}")
    if args.certificate_gamma is not None and not 0.0 <= args.certificate_gamma <= 1.0:
        fail(f"--certificate-gamma must lie in [0, 1], got {args.certificate_gamma}")
    torch.set_num_threads(1)
    ckpt = common.load_checkpoint(args.checkpoint, "", {"args": dict})
    if ckpt["algorithm"] not in SCRIPTS:
        fail(f"checkpoint {args.checkpoint} was saved by {ckpt['algorithm']}.py, which this repository does not have")
    ckpt, _, probs, q_function = load_script(ckpt["algorithm"]).load_policy(args.checkpoint, args.eval_greedy)
    saved = ckpt["args"]
    epsilon = saved.get("epsilon")
    if not isinstance(epsilon, float):
        fail(f"checkpoint {args.checkpoint} has no epsilon in its args; save it again with --save-model")
    require(isinstance(saved.get("dataset_path"), (str, type(None))), f"checkpoint {args.checkpoint}: its dataset_path "
            f"{saved.get('dataset_path')!r} is not a path; pass --dataset-path")
    run = common.RunArgs(env_id=ckpt["env_id"], epsilon=epsilon, batch_size=1,
                         dataset_path=args.dataset_path or saved.get("dataset_path"))
    dataset_path, data = common.load_dataset(run, ckpt["obs_dim"], ckpt["n_actions"], behavior_network=True,
                                             other_batch="the certificate is about the batch the policy was trained on: "
                                             "pass that batch as --dataset-path")
    beta = data["behavior_probs"].astype(np.float64)
    beta /= beta.sum(1, keepdims=True)  # as brpo.py: sum_a (pi - beta) = 0 to rounding
    behavior = common.behavior_policy(data)
    gamma = args.certificate_gamma if args.certificate_gamma is not None else saved.get("certificate_gamma", 0.99)
    require(isinstance(gamma, float) and 0.0 <= gamma <= 1.0, f"checkpoint {args.checkpoint}: its certificate_gamma "
            f"{gamma} is not in [0, 1]; pass --certificate-gamma")
    cert, reason = common.certificate_data(data, beta, gamma, behavior)
    if reason:
        fail(f"dataset {dataset_path} cannot certify: {reason}")
    obs = torch.from_numpy(data["observations"][cert["rows"]])[None]  # the policy as one member: [1, N, dim]
    pi = probs(obs, cert["beta"][None])[0]
    q = q_function(obs)[0] if q_function else cert["q_b"]
    if not (np.isfinite(pi).all() and np.isfinite(q).all()):
        fail(f"checkpoint {args.checkpoint} gives NaN or inf probabilities or values on the batch's states")
    z = statistics.NormalDist().inv_cdf(args.certificate_confidence)
    c = {**common.improvement_certificate(pi, q, cert, z), "tv_to_beta": common.tv_to_beta(pi, cert["beta"]),
         "episodes": cert["n_episodes"], "certificate_confidence": args.certificate_confidence, "dataset_path": str(dataset_path),
         "algorithm": ckpt["algorithm"]}
    if args.json:
        print(json.dumps(c))
        return
    print(f"{args.checkpoint} ({ckpt['algorithm']}.py) against beta on {dataset_path}: improvement {c['certificate']:.4g} "
          f"+- {c['certificate_se']:.3g} over {c['episodes']} logged episodes, {args.certificate_confidence:.0%} lower bound "
          f"{c['certificate_lcb']:.4g}: {'certified' if c['certified'] else 'not certified'} (mean total variation to "
          f"beta {c['tv_to_beta']:.3g})" + (f"; pi puts up to {c['off_support_mass']:.3g} of a state's probability on "
          "actions beta never takes, where no logged return can check the critic, so it cannot be certified"
          if c.get("off_support_mass", 0.0) > common.OFF_SUPPORT_TOLERANCE else "")
          + ("; the bound is at rounding level (constant returns?), so nothing is certified" if not c["certified"]
             and c["certificate_lcb"] > 0 and c.get("off_support_mass", 0.0) <= common.OFF_SUPPORT_TOLERANCE else ""))


if __name__ == "__main__":
    common.cli(Args, main)
