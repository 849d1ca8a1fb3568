"""bc.py learns the behaviour policy: its action distribution approaches the stored beta(.|s)."""

from __future__ import annotations

import numpy as np
import torch

from test_common import load_script, main_in_process


def test_bc_recovers_behaviour_policy(datasets, tmp_path):
    bc = load_script("bc.py")
    main_in_process(bc, dataset_path=str(datasets[0.15]), runs_dir=str(tmp_path), run_name="bc", total_steps=3000,
                    eval_frequency=3000, eval_episodes=2, save_model=True, tensorboard=False)
    ckpt = torch.load(tmp_path / "bc" / "model.pt", weights_only=True)
    net = bc.PolicyNetwork(ckpt["obs_dim"], ckpt["n_actions"])
    net.load_state_dict(ckpt["policy_network"])
    with np.load(datasets[0.15]) as f:
        obs, beta = f["observations"], f["behavior_probs"]
    with torch.no_grad():
        pi = torch.softmax(net(torch.as_tensor(obs)), 1).numpy()
    total_variation = 0.5 * np.abs(pi - beta).sum(1).mean()
    # beta = (0.925, 0.075) up to the greedy action; uniform would be at 0.425, an untrained net near it.
    assert total_variation < 0.2, total_variation
    # The greedy behaviour action is the cloned policy's most likely action on most states.
    assert np.mean(pi.argmax(1) == beta.argmax(1)) > 0.9
